"""`rasterization` on CPU: gsplat 1.4.0's `rasterization` contract, computed with PyTorch ops.

Why: gsplat has no CPU rasterizer; the project trains and tests on CPU. The pipeline mirrors gsplat's
`rendering.py` step by step (projection -> opacities x compensation -> SH colors -> depth channel -> tiles ->
compositing -> expected depth) so that every meta entry a strategy or a model reads means the same thing.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .composite import RasterizeToPixelsCPU
from .projection import project
from .sh import sh_colors
from .tiles import TileGrid, build_isects, gsplat_tiles_per_gauss

# CPU work unit: sub-tiles of SUBTILE x SUBTILE pixels (must divide gsplat's tile_size; see tiles.py), and
# BATCH entries of a sub-tile list composited per step (see composite.py). Measured on 2 cores.
SUBTILE = 4
BATCH = 32


def rasterization_cpu(
    means: Tensor,
    quats: Tensor,
    scales: Tensor,
    opacities: Tensor,
    colors: Tensor,
    viewmats: Tensor,
    Ks: Tensor,
    width: int,
    height: int,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    radius_clip: float = 0.0,
    eps2d: float = 0.3,
    sh_degree: Optional[int] = None,
    packed: bool = True,
    tile_size: int = 16,
    backgrounds: Optional[Tensor] = None,
    render_mode: str = "RGB",
    sparse_grad: bool = False,
    absgrad: bool = False,
    rasterize_mode: str = "classic",
    channel_chunk: int = 32,
    distributed: bool = False,
    camera_model: str = "pinhole",
    covars: Optional[Tensor] = None,
    *,
    subtile: int = SUBTILE,
    batch: int = BATCH,
) -> Tuple[Tensor, Tensor, Dict]:
    """See `gsplat.rendering.rasterization`. `channel_chunk` has no effect here (any channel count is done at once)."""
    N = means.shape[0]
    C = viewmats.shape[0]
    assert means.shape == (N, 3), means.shape
    if covars is None:
        assert quats.shape == (N, 4), quats.shape
        assert scales.shape == (N, 3), scales.shape
    else:
        assert covars.shape == (N, 3, 3), covars.shape
    assert opacities.shape == (N,), opacities.shape
    assert viewmats.shape == (C, 4, 4), viewmats.shape
    assert Ks.shape == (C, 3, 3), Ks.shape
    assert render_mode in ["RGB", "D", "ED", "RGB+D", "RGB+ED"], render_mode
    assert rasterize_mode in ["classic", "antialiased"], rasterize_mode
    if sh_degree is None:
        assert (colors.dim() == 2 and colors.shape[0] == N) or (
            colors.dim() == 3 and colors.shape[:2] == (C, N)
        ), colors.shape
    else:
        assert (colors.dim() == 3 and colors.shape[0] == N and colors.shape[2] == 3) or (
            colors.dim() == 4 and colors.shape[:2] == (C, N) and colors.shape[3] == 3
        ), colors.shape
        assert (sh_degree + 1) ** 2 <= colors.shape[-2], colors.shape
    if means.device.type != "cpu":
        raise NotImplementedError(f"rasterization on {means.device.type!r} tensors: only CUDA (gsplat) and CPU")
    if distributed:
        raise NotImplementedError("rasterization(distributed=True) needs gsplat's CUDA path; not on CPU")
    if camera_model != "pinhole":
        raise NotImplementedError(f"rasterization(camera_model={camera_model!r}) on CPU: only 'pinhole'")
    if packed and sparse_grad:
        raise NotImplementedError("rasterization(sparse_grad=True) is not supported on CPU")

    radii, means2d, depths, conics, comps = project(
        means, quats, scales, covars, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
        calc_compensations=(rasterize_mode == "antialiased"),
    )
    opac = opacities.repeat(C, 1)  # [C, N]
    if comps is not None:
        opac = opac * comps

    if sh_degree is None:
        cols = colors.expand(C, -1, -1) if colors.dim() == 2 else colors  # [C, N, D]
    else:
        cols = sh_colors(sh_degree, colors, means, viewmats, radii > 0)  # [C, N, 3]

    if render_mode in ["RGB+D", "RGB+ED"]:
        cols = torch.cat((cols, depths[..., None]), dim=-1)
        if backgrounds is not None:
            backgrounds = torch.cat([backgrounds, backgrounds.new_zeros(C, 1)], dim=-1)
    elif render_mode in ["D", "ED"]:
        cols = depths[..., None]
        if backgrounds is not None:
            backgrounds = backgrounds.new_zeros(C, 1)

    if packed:
        # gsplat's packed layout: only visible (camera, Gaussian) pairs, in row-major order
        camera_ids, gaussian_ids = torch.nonzero(radii > 0, as_tuple=True)
        radii = radii[camera_ids, gaussian_ids]
        means2d = means2d[camera_ids, gaussian_ids]
        depths = depths[camera_ids, gaussian_ids]
        conics = conics[camera_ids, gaussian_ids]
        opac = opac[camera_ids, gaussian_ids]
        cols = cols[camera_ids, gaussian_ids]
        entry_cam = camera_ids
    else:
        camera_ids, gaussian_ids = None, None
        entry_cam = torch.arange(C, device=means.device).repeat_interleave(N)

    D = cols.shape[-1]
    m2 = means2d.reshape(-1, 2)
    grid = TileGrid(C, width, height, math.gcd(int(tile_size), int(subtile)))
    isects = build_isects(
        grid,
        m2.detach(),
        conics.reshape(-1, 3).detach(),
        opac.reshape(-1).detach(),
        depths.reshape(-1).detach(),
        radii.reshape(-1),
        entry_cam,
        tile_size,
    )
    render_colors, render_alphas = RasterizeToPixelsCPU.apply(
        m2,
        conics.reshape(-1, 3),
        cols.reshape(-1, D),
        opac.reshape(-1),
        backgrounds,
        isects,
        batch,
        absgrad,
        means2d if absgrad else None,
    )
    if render_mode in ["ED", "RGB+ED"]:
        render_colors = torch.cat(
            [render_colors[..., :-1], render_colors[..., -1:] / render_alphas.clamp(min=1e-10)], dim=-1
        )

    tile_width = math.ceil(width / float(tile_size))
    tile_height = math.ceil(height / float(tile_size))
    meta = {
        "camera_ids": camera_ids,
        "gaussian_ids": gaussian_ids,
        "radii": radii,
        "means2d": means2d,
        "depths": depths,
        "conics": conics,
        "opacities": opac,
        "tile_width": tile_width,
        "tile_height": tile_height,
        "tiles_per_gauss": gsplat_tiles_per_gauss(means2d.detach(), radii, tile_size, width, height),
        # gsplat's CUDA intersection buffers (16x16 tiles, bit-packed keys) are not built on CPU
        "isect_ids": None,
        "flatten_ids": None,
        "isect_offsets": None,
        "width": width,
        "height": height,
        "tile_size": tile_size,
        "n_cameras": C,
    }
    return render_colors, render_alphas, meta
