"""View-dependent colors from spherical harmonics, as gsplat's `rasterization` computes them.

Why: gsplat evaluates SH with a CUDA kernel; its PyTorch twin's polynomial basis (`_eval_sh_bases_fast`, reused
here) runs on CPU and is differentiable w.r.t. both coefficients and view directions (so the means get the SH
gradient too, as in gsplat's backward). The direction's normalization and the sum over the basis are written out
element-wise (a fixed order of additions), so that a Gaussian's colour is the same bits whatever other Gaussians
share the call (see projection.py: owners project their own Gaussians for other ranks' views). The +0.5 offset and
clamp at 0 are gsplat's ("apple-to-apple with Inria's CUDA backend"). Like gsplat's kernel (given
`masks = radii > 0`), only visible (camera, Gaussian) pairs are evaluated; the others are 0.
"""

from __future__ import annotations

import torch
from gsplat.cuda._torch_impl import _eval_sh_bases_fast
from torch import Tensor


def sh_rgb(sh_degree: int, dirs: Tensor, coeffs: Tensor) -> Tensor:
    """dirs [N, 3] (not normalized), coeffs [N, K, 3] -> [N, 3] = sum_k basis_k(dirs) coeffs_k + 0.5, clamped at 0."""
    x, y, z = dirs.unbind(-1)
    norm = torch.sqrt(x * x + y * y + z * z).clamp_min(1e-12)  # F.normalize's eps
    unit = torch.stack([x / norm, y / norm, z / norm], dim=-1)
    num_bases = (sh_degree + 1) ** 2
    bases = _eval_sh_bases_fast(num_bases, unit).unbind(1)  # num_bases x [N]
    terms = coeffs.unbind(1)
    out = bases[0][:, None] * terms[0]
    for k in range(1, num_bases):
        out = out + bases[k][:, None] * terms[k]
    return torch.clamp_min(out + 0.5, 0.0)


def sh_colors(sh_degree: int, coeffs: Tensor, means: Tensor, viewmats: Tensor, visible: Tensor) -> Tensor:
    """coeffs [N, K, 3] or [C, N, K, 3], visible [C, N] -> colors [C, N, 3] seen from each camera center."""
    C, N = visible.shape
    campos = torch.inverse(viewmats)[:, :3, 3]  # [C, 3]
    out = []
    for c in range(C):
        ids = visible[c].nonzero().squeeze(1)
        shs = (coeffs if coeffs.dim() == 3 else coeffs[c]).index_select(0, ids)
        col = sh_rgb(sh_degree, means.index_select(0, ids) - campos[c], shs)
        out.append(means.new_zeros(N, 3).index_copy(0, ids, col))
    return torch.stack(out)
