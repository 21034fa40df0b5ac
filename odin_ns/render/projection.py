"""Projection of 3D Gaussians to 2D on CPU, with gsplat's numerics.

Why: gsplat's `fully_fused_projection` is a CUDA kernel. Its PyTorch reference
(`gsplat.cuda._torch_impl._fully_fused_projection` / `_persp_proj`) is differentiable and runs on CPU; we reuse it
rather than re-derive it, so the 1.3x field-of-view clamp of the Jacobian, the eps2d low-pass dilation, the
antialiasing compensation sqrt(det / det_dilated), near/far culling, radius = ceil(3 sqrt(max eigenvalue)) and
the off-screen cull are gsplat's own code.

Added here:
- `radius_clip` (the CUDA kernel culls radius <= clip; the PyTorch reference ignores it);
- culled entries get exactly zero outputs and zero gradients, as with gsplat's kernels. The reference computes
  every (camera, Gaussian) pair, and for a Gaussian on a camera's plane (z = 0) its 0/0 poisons autograd
  (0 * inf = NaN in the chain rule). So culling is decided by a no-grad pass, and the differentiable pass only
  sees each camera's visible Gaussians (which is also cheaper when a view sees a fraction of the scene).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci
from torch import Tensor


def project(
    means: Tensor,  # [N, 3]
    quats: Optional[Tensor],  # [N, 4] (normalized here)
    scales: Optional[Tensor],  # [N, 3]
    covars: Optional[Tensor],  # [N, 3, 3], replaces quats/scales when given
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    eps2d: float,
    near_plane: float,
    far_plane: float,
    radius_clip: float,
    calc_compensations: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Returns radii [C, N] int32 (0 = culled), means2d [C, N, 2], depths [C, N], conics [C, N, 3] and
    compensations [C, N] (or None); zeros where culled."""
    if covars is None:
        covars, _ = _quat_scale_to_covar_preci(quats, scales, compute_covar=True, compute_preci=False, triu=False)
    kw = dict(eps2d=eps2d, near_plane=near_plane, far_plane=far_plane, camera_model="pinhole")
    C, N = viewmats.shape[0], means.shape[0]
    with torch.no_grad():
        radii = _fully_fused_projection(
            means.detach(), covars.detach(), viewmats, Ks, width, height, calc_compensations=False, **kw
        )[0]
        if radius_clip > 0.0:
            radii = torch.where(radii.to(torch.float64) <= radius_clip, torch.zeros_like(radii), radii)
    radii = radii.to(torch.int32)

    m2s, ds, cons, comps = [], [], [], []
    for c in range(C):
        ids = (radii[c] > 0).nonzero().squeeze(1)
        _, m2, d, con, comp = _fully_fused_projection(
            means.index_select(0, ids), covars.index_select(0, ids), viewmats[c : c + 1], Ks[c : c + 1],
            width, height, calc_compensations=calc_compensations, **kw,
        )
        m2s.append(means.new_zeros(N, 2).index_copy(0, ids, m2[0]))
        ds.append(means.new_zeros(N).index_copy(0, ids, d[0]))
        cons.append(means.new_zeros(N, 3).index_copy(0, ids, con[0]))
        if calc_compensations:
            comps.append(means.new_zeros(N).index_copy(0, ids, comp[0]))
    return (
        radii,
        torch.stack(m2s),
        torch.stack(ds),
        torch.stack(cons),
        torch.stack(comps) if calc_compensations else None,
    )
