"""View-dependent colors from spherical harmonics, as gsplat's `rasterization` computes them.

Why: gsplat evaluates SH with a CUDA kernel; its PyTorch twin `_spherical_harmonics` (reused here, it is the
same polynomial basis) runs on CPU and is differentiable w.r.t. both coefficients and view directions (so the
means get the SH gradient too, as in gsplat's backward). The +0.5 offset and clamp at 0 are gsplat's
("apple-to-apple with Inria's CUDA backend").
"""

from __future__ import annotations

import torch
from gsplat.cuda._torch_impl import _spherical_harmonics
from torch import Tensor


def sh_colors(sh_degree: int, coeffs: Tensor, means: Tensor, viewmats: Tensor) -> Tensor:
    """coeffs [N, K, 3] or [C, N, K, 3] -> colors [C, N, 3] seen from each camera center."""
    C = viewmats.shape[0]
    camtoworlds = torch.inverse(viewmats)  # [C, 4, 4]
    dirs = means[None, :, :] - camtoworlds[:, None, :3, 3]  # [C, N, 3]
    shs = coeffs.expand(C, -1, -1, -1) if coeffs.dim() == 3 else coeffs
    colors = _spherical_harmonics(sh_degree, dirs, shs)
    return torch.clamp_min(colors + 0.5, 0.0)
