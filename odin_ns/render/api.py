"""The renderer's one entry point: gsplat's kernels on CUDA, the PyTorch CPU path elsewhere.

Odin never changes gsplat's kernels: on CUDA tensors this is exactly `gsplat.rasterization`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from torch import Tensor
from typing_extensions import Literal

from .cpu import rasterization_cpu


def rasterization(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4]
    scales: Tensor,  # [N, 3]
    opacities: Tensor,  # [N]
    colors: Tensor,  # [(C,) N, D] or [(C,) N, K, 3]
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
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
    render_mode: Literal["RGB", "D", "ED", "RGB+D", "RGB+ED"] = "RGB",
    sparse_grad: bool = False,
    absgrad: bool = False,
    rasterize_mode: Literal["classic", "antialiased"] = "classic",
    channel_chunk: int = 32,
    distributed: bool = False,
    camera_model: Literal["pinhole", "ortho", "fisheye"] = "pinhole",
    covars: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Dict]:
    """Same signature, arguments and results as `gsplat.rendering.rasterization` (gsplat 1.4.0)."""
    kwargs = dict(
        means=means, quats=quats, scales=scales, opacities=opacities, colors=colors, viewmats=viewmats, Ks=Ks,
        width=width, height=height, near_plane=near_plane, far_plane=far_plane, radius_clip=radius_clip,
        eps2d=eps2d, sh_degree=sh_degree, packed=packed, tile_size=tile_size, backgrounds=backgrounds,
        render_mode=render_mode, sparse_grad=sparse_grad, absgrad=absgrad, rasterize_mode=rasterize_mode,
        channel_chunk=channel_chunk, distributed=distributed, camera_model=camera_model, covars=covars,
    )
    if means.is_cuda:
        from gsplat.rendering import rasterization as gsplat_rasterization

        return gsplat_rasterization(**kwargs)
    return rasterization_cpu(**kwargs)
