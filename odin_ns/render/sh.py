"""View-dependent colors from spherical harmonics, as gsplat's `rasterization` computes them.

Why: gsplat evaluates SH with a CUDA kernel; its PyTorch twin `_spherical_harmonics` (reused here, it is the
same polynomial basis) runs on CPU and is differentiable w.r.t. both coefficients and view directions (so the
means get the SH gradient too, as in gsplat's backward). The +0.5 offset and clamp at 0 are gsplat's
("apple-to-apple with Inria's CUDA backend"). Like gsplat's kernel (given `masks = radii > 0`), only visible
(camera, Gaussian) pairs are evaluated; the others are 0.
"""

from __future__ import annotations

import torch
from gsplat.cuda._torch_impl import _spherical_harmonics
from torch import Tensor


def sh_colors(sh_degree: int, coeffs: Tensor, means: Tensor, viewmats: Tensor, visible: Tensor) -> Tensor:
    """coeffs [N, K, 3] or [C, N, K, 3], visible [C, N] -> colors [C, N, 3] seen from each camera center."""
    C, N = visible.shape
    campos = torch.inverse(viewmats)[:, :3, 3]  # [C, 3]
    out = []
    for c in range(C):
        ids = visible[c].nonzero().squeeze(1)
        shs = (coeffs if coeffs.dim() == 3 else coeffs[c]).index_select(0, ids)
        dirs = means.index_select(0, ids) - campos[c]
        col = torch.clamp_min(_spherical_harmonics(sh_degree, dirs, shs) + 0.5, 0.0)
        out.append(means.new_zeros(N, 3).index_copy(0, ids, col))
    return torch.stack(out)
