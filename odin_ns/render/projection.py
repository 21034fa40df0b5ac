"""Projection of 3D Gaussians to 2D on CPU, with gsplat's numerics.

Why: gsplat's `fully_fused_projection` is a CUDA kernel. Its PyTorch reference
(`gsplat.cuda._torch_impl._fully_fused_projection` / `_persp_proj`) is differentiable and runs on CPU; we reuse it
rather than re-derive it, so the 1.3x field-of-view clamp of the Jacobian, the eps2d low-pass dilation, the
antialiasing compensation sqrt(det / det_dilated), near/far culling, radius = ceil(3 sqrt(max eigenvalue)) and
the off-screen cull are gsplat's own code. Added here: `radius_clip` (the CUDA kernel culls radius <= clip, the
reference ignores it) and the pinhole-only guard.
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
    """Returns radii [C, N] int32 (0 = culled), means2d [C, N, 2], depths [C, N], conics [C, N, 3], compensations."""
    if covars is None:
        covars, _ = _quat_scale_to_covar_preci(quats, scales, compute_covar=True, compute_preci=False, triu=False)
    radii, means2d, depths, conics, comps = _fully_fused_projection(
        means,
        covars,
        viewmats,
        Ks,
        width,
        height,
        eps2d=eps2d,
        near_plane=near_plane,
        far_plane=far_plane,
        calc_compensations=calc_compensations,
        camera_model="pinhole",
    )
    if radius_clip > 0.0:
        radii = torch.where(radii.to(torch.float64) <= radius_clip, torch.zeros_like(radii), radii)
    return radii.to(torch.int32), means2d, depths, conics, comps
