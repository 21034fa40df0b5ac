"""Rasterizer backends behind one function, `rasterization` (gsplat 1.4.0's signature).

On CUDA tensors it is gsplat's own `rasterization` (its kernels, unchanged); elsewhere a PyTorch CPU
implementation with gsplat's numerics (see cpu.py).
"""

from .api import rasterization
from .cpu import rasterization_cpu

__all__ = ["rasterization", "rasterization_cpu"]
