"""`make gpu-check`: the checks of the CUDA path a person runs on a CUDA machine, with absolute figures.

1. the cuda-marked tests: gsplat's kernels against the CPU rasterizer on one scene, one rank training on the GPU,
   NCCL ranks equal to one process (with a GPU per rank);
2. the two halves of the splat data path timed apart at 1M and 6M Gaussians, all in the image and half out of it
   (`python -m odin_ns.render.bench --halves`): the figures of the H200 model in `schedule/gpu_costs.py` (a
   Gaussian's cost in view, and `CULLED_SHARE`);
3. the runtime's own time a step on one GPU rank at 1M Gaussians (`odin-bench scale --ranks 1 --device cuda`:
   update, bookkeeping and loop against an Adam floor timed on the GPU, its operations and host syncs);
4. a short `odin-bench train` of the policies on NCCL ranks (2 GPUs or more; NCCL refuses two ranks on one GPU).
Without CUDA it says so in one line and exits 0: nothing here can be checked on a CPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine: nothing to check (the CPU path is `make test`)")
        return 0
    gpus = torch.cuda.device_count()
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
          flush=True)
    tests = Path(__file__).resolve().parents[2] / "tests"
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", str(tests)])
    for outside in ("0", "0.5"):  # timed whatever the tests said: a device's time is short
        code = subprocess.call([sys.executable, "-m", "odin_ns.render.bench", "--halves", "--device", "cuda",
                                "--sizes", "1000000x1297x840", "6000000x1297x840", "--outside", outside]) or code
    code = subprocess.call([sys.executable, "-m", "odin_ns.cli.bench", "scale", "--ranks", "1", "--device", "cuda",
                            "--sizes", "1000000", "--block-sizes", "4096", "--policies", "odin", "--steps", "16"]) \
        or code
    if code != 0:
        return code
    if gpus < 2:
        print("gpu-check: one GPU: the policies' side-by-side bench needs a GPU per rank (NCCL); skipped")
        return 0
    return subprocess.call([sys.executable, "-m", "odin_ns.cli.bench", "train", "--ranks", str(gpus), "--steps", "200",
                            "--out", "gpu-check-bench", "--", "--machine.device-type", "cuda"])


if __name__ == "__main__":
    sys.exit(main())
