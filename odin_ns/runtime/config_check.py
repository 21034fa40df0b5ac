"""Every rank must train the same configuration: compare a hash of it across ranks before any work starts; and, on
CPU ranks, say where their CPU kernels round differently (the result is then not one process's bit for bit)."""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import yaml

from odin_ns.errors import OdinInputError


def config_fingerprint(config) -> str:
    """A hash of the configuration as nerfstudio saves it (yaml)."""
    return hashlib.sha256(yaml.dump(config).encode()).hexdigest()[:16]


def cpu_kernels() -> str:
    """The vector width torch's CPU kernels run at in this process (DEFAULT, AVX2, AVX512, ...: the processor's
    widest unless `ATEN_CPU_CAPABILITY` narrows it)."""
    return torch.backends.cpu.get_cpu_capability()


def check_same_config(config, rank: int, world_size: int, cpu: bool = True,
                      kernels: Optional[str] = None) -> Optional[str]:
    """All-gather each rank's fingerprint and the vector width of its CPU kernels (`kernels`, default this
    process's); on a configuration mismatch every rank stops with the same one-line error. Training on CPU ranks
    (`cpu`), ranks whose kernels differ get a warning back (`kernels_warning`)."""
    gathered: List[Optional[Tuple[str, str]]] = [None] * world_size
    dist.all_gather_object(gathered, (config_fingerprint(config), kernels or cpu_kernels()))
    odd = [r for r, (f, _) in enumerate(gathered) if f != gathered[0][0]]
    if odd:
        raise OdinInputError(f"ranks {odd} were started with a configuration different from rank 0's "
                             "(every rank must get the same arguments)")
    return kernels_warning([k for _, k in gathered]) if cpu else None


WIDTHS = ("DEFAULT", "AVX2", "AVX512")  # torch's x86 CPU capabilities, narrowest first


def kernels_warning(kernels: Sequence[str]) -> Optional[str]:
    """None where every rank's CPU kernels run at one vector width; else what differs and the fix. Vectorized and
    scalar kernels round differently (measured on this project's machine: torch's fused Adam over the same state
    gives other bits at DEFAULT than at AVX2, and exp and sigmoid differ between each of DEFAULT, AVX2 and
    AVX512), so such ranks train a model that is not one process's bit for bit (it still trains)."""
    if len(set(kernels)) <= 1:
        return None
    ranks = "; ".join(f"{k} on rank(s) {[r for r, x in enumerate(kernels) if x == k]}" for k in sorted(set(kernels)))
    known = [w for w in WIDTHS if w in kernels]
    fix = (f"set ATEN_CPU_CAPABILITY={known[0].lower()} on every node" if known and set(kernels) <= set(WIDTHS)
           else "run every rank on processors of one kind")
    return (f"the ranks run torch's CPU kernels at different vector widths ({ranks}): they round differently, so "
            f"the result is not one process's bit for bit; {fix} to make it so")
