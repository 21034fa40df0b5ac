"""Write (or remove) the one-line `.pth` file that activates `torchvision_hook` in this environment.

Run as `python -m odin_ns.compat.install_pth`. It writes the file only where it is needed: when torchvision is
installed and its compiled extension cannot load beside the installed torch (CPU torch + CUDA torchvision).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

PTH_NAME = "odin_ns_torchvision_hook.pth"
PTH_LINE = "import odin_ns.compat.torchvision_hook\n"

_PROBE = "import torchvision, sys; sys.exit(0)"


def needed() -> bool:
    """True when a plain `import torchvision` fails in a fresh interpreter without the hook."""
    env = dict(os.environ, PYTHONNOUSERSITE="1")
    probe = subprocess.run([sys.executable, "-S", "-c", "import site; site.main(); " + _PROBE],
                           env=env, capture_output=True, text=True)
    return probe.returncode != 0 and "torchvision::" in probe.stderr


def main() -> int:
    target = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
    if os.path.exists(target):
        os.remove(target)
    if not needed():
        print("torchvision imports as installed; no hook needed")
        return 0
    with open(target, "w") as f:
        f.write(PTH_LINE)
    check = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if check.returncode != 0:
        print(check.stderr, file=sys.stderr)
        print("torchvision still fails to import; reinstall a matching torch/torchvision pair", file=sys.stderr)
        return 1
    print(f"wrote {target}: torchvision imports beside this CPU torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
