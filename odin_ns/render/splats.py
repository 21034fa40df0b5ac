"""gsplat's rendering cut in its two halves, as its distributed mode cuts it: projection, then rasterization.

`project_splats` is the owner's half: a view's camera and some Gaussians (their raw parameters) to the splats of
those that are visible, each a row of `SPLAT_WIDTH` numbers (2-D mean, depth, conic, opacity after antialiasing,
RGB from the SH coefficients) plus its integer radius. `rasterize_splats` is the reader's half: splats from any
number of owners, in one fixed order, to the image. Composed, they are `rasterization(..., packed=False)` for one
camera: the same pixels and the same gradients, bit for bit on the CPU (tests/test_render_splats.py).

On CUDA each half is gsplat's own kernels, as `gsplat.rendering.rasterization(distributed=True)` calls them
(`fully_fused_projection` and `spherical_harmonics` on the owner; `isect_tiles`, `isect_offset_encode` and
`rasterize_to_pixels` on the reader). On the CPU the halves are this package's: the projection written element by
element, so that a Gaussian's splat does not depend on which others an owner projects with it (projection.py),
and the activations of the raw parameters (exp of the log-scales, sigmoid of the logit opacities) through
`partition_free` for the same reason.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .projection import RowCameras

SPLAT_WIDTH = 10  # means2d (2), depth, conic (3), opacity, RGB (3)
MEANS2D, DEPTH, CONIC, OPACITY, RGB = slice(0, 2), 2, slice(3, 6), 6, slice(7, 10)


def _gsplat_kernels(t: Tensor) -> bool:
    """Whether the halves run gsplat's kernels on `t` (CUDA) rather than this package's (the CPU)."""
    return t.is_cuda


def project_splats(means: Tensor, quats: Tensor, log_scales: Tensor, logit_opacities: Tensor, coeffs: Tensor,
                   cams: RowCameras, sh_degree: Optional[int], antialiased: bool, near_plane: float = 0.01,
                   far_plane: float = 1e10, eps2d: float = 0.3) -> Tuple[Tensor, Tensor, Tensor]:
    """The visible splats of N Gaussians, each in its camera (`cams`: one for all, or on the CPU one per row: an
    owner projects for several views at once).

    `coeffs` [N, K, 3] are SH coefficients (DC first) for `sh_degree`, or, with `sh_degree` None, logits of
    the colour ([N, 1, 3], splatfacto's colour without SH). Returns (ids [n]: which of the N are visible, in
    ascending order; radii [n] int32; splats [n, SPLAT_WIDTH], differentiable w.r.t. the inputs)."""
    if _gsplat_kernels(means):
        return _project_cuda(means, quats, log_scales, logit_opacities, coeffs, cams, sh_degree, antialiased,
                             near_plane, far_plane, eps2d)
    from .projection import covariances, partition_free, project_visible
    from .sh import sh_rgb

    scales = partition_free(torch.exp, log_scales)
    ids, radii, m2, depth, conic, comp = project_visible(
        means, covariances(quats, scales, None), cams, eps2d, near_plane, far_plane, 0.0, antialiased)
    opacity = partition_free(torch.sigmoid, logit_opacities.index_select(0, ids).reshape(-1))
    if comp is not None:
        opacity = opacity * comp
    if sh_degree is None:
        rgb = partition_free(torch.sigmoid, coeffs.index_select(0, ids)[:, 0, :])
    else:
        campos = cams.position(ids).to(means.device)
        rgb = sh_rgb(sh_degree, means.index_select(0, ids) - campos, coeffs.index_select(0, ids))
    return ids, radii, torch.cat([m2, depth[:, None], conic, opacity[:, None], rgb], dim=1)


def _project_cuda(means, quats, log_scales, logit_opacities, coeffs, cams, sh_degree, antialiased, near_plane,
                  far_plane, eps2d):
    """gsplat's projection and SH kernels, packed (only visible pairs), one camera."""
    from gsplat.cuda._wrapper import fully_fused_projection, spherical_harmonics

    if cams.viewmats.shape[0] != 1:
        raise ValueError("on CUDA, project_splats takes one camera for all rows (gsplat's kernels)")
    width, height = (int(v) for v in cams.sizes[0].tolist())
    _, ids, radii, m2, depth, conic, comp = fully_fused_projection(
        means, None, quats, torch.exp(log_scales), cams.viewmats, cams.Ks, width, height, eps2d=eps2d,
        near_plane=near_plane, far_plane=far_plane, packed=True, calc_compensations=antialiased)
    opacity = torch.sigmoid(logit_opacities.reshape(-1))[ids]
    if comp is not None:
        opacity = opacity * comp
    if sh_degree is None:
        rgb = torch.sigmoid(coeffs[ids, 0, :])
    else:
        campos = torch.inverse(cams.viewmats[0])[:3, 3]
        rgb = torch.clamp_min(spherical_harmonics(sh_degree, means[ids] - campos, coeffs[ids]) + 0.5, 0.0)
    return ids.long(), radii.to(torch.int32), torch.cat([m2, depth[:, None], conic, opacity[:, None], rgb], dim=1)


def rasterize_splats(splats: Tensor, radii: Tensor, width: int, height: int, render_mode: str = "RGB",
                     absgrad: bool = False, tile_size: int = 16) -> Tuple[Tensor, Tensor, Tensor]:
    """One camera's image from splats [n, SPLAT_WIDTH] in the order given (the depth sort keeps it for ties).

    Returns (colors [1, H, W, 3 or 4], alphas [1, H, W, 1], means2d): with `render_mode` "RGB+ED" the last colour
    channel is the expected depth; with `absgrad`, `means2d.absgrad` holds each splat's summed absolute screen-space
    gradient after the backward pass (gsplat's contract)."""
    if render_mode not in ("RGB", "RGB+ED"):
        raise ValueError(f"rasterize_splats: render mode {render_mode!r} (RGB or RGB+ED)")
    m2 = splats[:, MEANS2D]
    depth, conic, opacity = splats[:, DEPTH], splats[:, CONIC], splats[:, OPACITY]
    colors = splats[:, RGB]
    if render_mode == "RGB+ED":
        colors = torch.cat([colors, depth[:, None]], dim=1)
    if _gsplat_kernels(splats):
        # gsplat's wrapper hands `means2d.contiguous()` to its autograd function, whose backward puts `absgrad` on
        # that tensor: a strided slice would get it on a copy, and the caller none
        m2 = m2.contiguous()
        render, alpha = _rasterize_cuda(m2, radii, depth, conic, colors, opacity, width, height, tile_size, absgrad)
    else:
        from .composite import RasterizeToPixelsCPU
        from .cpu import BATCH, SUBTILE
        from .tiles import TileGrid, build_isects

        grid = TileGrid(1, width, height, math.gcd(int(tile_size), SUBTILE))
        isects = build_isects(grid, m2.detach(), conic.detach(), opacity.detach(), depth.detach(), radii,
                              torch.zeros(splats.shape[0], dtype=torch.int64), tile_size)
        render, alpha = RasterizeToPixelsCPU.apply(m2, conic, colors, opacity, None, isects, BATCH, absgrad,
                                                   m2 if absgrad else None)
    if render_mode == "RGB+ED":
        render = torch.cat([render[..., :-1], render[..., -1:] / alpha.clamp(min=1e-10)], dim=-1)
    return render, alpha, m2


def _rasterize_cuda(m2, radii, depth, conic, colors, opacity, width, height, tile_size, absgrad):
    """gsplat's tile intersection and rasterization kernels on packed splats of one camera."""
    from gsplat.cuda._wrapper import isect_offset_encode, isect_tiles, rasterize_to_pixels

    tw, th = math.ceil(width / tile_size), math.ceil(height / tile_size)
    n = m2.shape[0]
    cams = torch.zeros(n, dtype=torch.int64, device=m2.device)
    _, isect_ids, flatten_ids = isect_tiles(m2, radii, depth, tile_size, tw, th, packed=True, n_cameras=1,
                                            camera_ids=cams, gaussian_ids=torch.arange(n, device=m2.device))
    offsets = isect_offset_encode(isect_ids, 1, tw, th)
    return rasterize_to_pixels(m2, conic, colors, opacity, width, height, tile_size, offsets, flatten_ids,
                               packed=True, absgrad=absgrad)
