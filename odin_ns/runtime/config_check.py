"""Every rank must train the same configuration: compare a hash of it across ranks before any work starts; and, on
CPU ranks, say where their CPU kernels round differently (the result is then not one process's bit for bit)."""

from __future__ import annotations

import hashlib
import os
import platform
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import yaml

from odin_ns.errors import OdinInputError


def config_fingerprint(config) -> str:
    """A hash of the configuration as nerfstudio saves it (yaml)."""
    return hashlib.sha256(yaml.dump(config).encode()).hexdigest()[:16]


def cpu_kernels() -> Tuple[str, str, str, str]:
    """How this process's CPU kernels round, as the ranks compare it: (processor, torch's width, the widest the
    processor has, MKL_CBWR or ""). torch's own kernels run at the width `torch.backends.cpu.get_cpu_capability()` names
    (DEFAULT, AVX2, AVX512, ...: the processor's widest unless `ATEN_CPU_CAPABILITY` narrows it); matrix products
    go to MKL, which picks its own from the processor unless `MKL_CBWR` fixes it."""
    width = torch.backends.cpu.get_cpu_capability().replace("NO AVX", "DEFAULT")
    widest = ("AVX512" if torch.cpu._is_avx512_supported() else "AVX2" if torch.cpu._is_avx2_supported()
              else "DEFAULT") if platform.machine() in ("x86_64", "AMD64") else width
    return platform.machine(), width, widest, os.environ.get("MKL_CBWR", "")


def check_same_config(config, rank: int, world_size: int, *, cpu: bool,
                      kernels: Optional[Tuple[str, str, str, str]] = None) -> Optional[str]:
    """All-gather each rank's fingerprint and how its CPU kernels round (`kernels`, default this process's
    `cpu_kernels`); on a configuration mismatch every rank stops with the same one-line error. Training on CPU
    ranks (`cpu`), ranks whose kernels differ get a warning back (`kernels_warning`)."""
    gathered: List[object] = [None] * world_size
    dist.all_gather_object(gathered, (config_fingerprint(config), kernels or cpu_kernels()))
    prints = [g[0] if isinstance(g, tuple) else g for g in gathered]  # (an older odin sends the fingerprint alone)
    odd = [r for r, f in enumerate(prints) if f != prints[0]]
    if odd:
        raise OdinInputError(f"ranks {odd} were started with a configuration different from rank 0's "
                             "(every rank must get the same arguments)")
    return kernels_warning([tuple(g[1]) for g in gathered]) if cpu else None


WIDTHS = ("DEFAULT", "AVX2", "AVX512")  # torch's x86 CPU capabilities, narrowest first
MKL_WIDTHS = {"DEFAULT": "COMPATIBLE", "AVX2": "AVX2", "AVX512": "AVX512"}  # MKL_CBWR's names for them


def kernels_warning(kernels: Sequence[Tuple[str, str, str, str]]) -> Optional[str]:
    """None where every rank's CPU kernels round alike (`cpu_kernels` of each); else what differs and the fix.
    Vectorized and scalar kernels round differently (measured on this project's machine: torch's fused Adam over
    the same state gives other bits at DEFAULT than at AVX2; exp and sigmoid differ between each of DEFAULT, AVX2
    and AVX512; `torch.bmm`, which the CPU rasterizer's backward runs, differs with MKL's instruction set), so such
    ranks train a model that is not one process's bit for bit (it still trains). Processors of different widths
    round alike once every rank sets the same `ATEN_CPU_CAPABILITY` and `MKL_CBWR`."""
    arch, width, widest, cbwr = (list(x) for x in zip(*kernels))
    alike = len(set(arch)) == 1 and len(set(width)) == 1 and (
        len(set(widest)) == 1 and len(set(cbwr)) == 1 or len(set(cbwr)) == 1 and cbwr[0] != "")
    if alike:
        return None
    ranks = "; ".join(f"{a} {w} (processor {h}{', MKL_CBWR=' + c if c else ''}) on rank(s) "
                      f"{[r for r, k in enumerate(kernels) if k == (a, w, h, c)]}"
                      for a, w, h, c in sorted(set(kernels)))
    if len(set(arch)) > 1 or not set(width) | set(widest) <= set(WIDTHS):
        fix = "run every rank on processors of one kind"
    else:
        narrowest = min(width + widest, key=WIDTHS.index)
        fix = f"set ATEN_CPU_CAPABILITY={narrowest.lower()} and MKL_CBWR={MKL_WIDTHS[narrowest]} on every node"
    return (f"the ranks' CPU kernels round differently ({ranks}), so the result is not one process's bit for bit; "
            f"{fix} to make it so")
