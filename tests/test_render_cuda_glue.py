"""The CUDA halves' calls into gsplat's kernels (`render/splats.py`: `_project_cuda`, `_rasterize_cuda`), run on
the CPU with gsplat's own PyTorch references (`gsplat.cuda._torch_impl`) standing in for the kernels. Each stand-in
first binds its arguments to the kernel wrapper's own signature (a wrong name, order or count fails here, not on a
GPU), then computes what the wrapper documents for the packed layout. What the glue does around the calls (ids and
radii types, the colours' offset, the camera's position, the compensation, the tiles' offsets) must give the CPU
path's splats, image and gradients. The kernels themselves are checked on a GPU (`tests/test_cuda.py`)."""

from __future__ import annotations

import inspect

import pytest
import torch
from gsplat.cuda import _torch_impl as ref
from gsplat.cuda import _wrapper

from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import (CONIC, DEPTH, MEANS2D, OPACITY, RGB, _project_cuda, _rasterize_cuda,
                                   project_splats, rasterize_splats)
from test_render_splats import H, W, leaves, loss_of, scene


# the kernels' wrappers, as gsplat defines them (the fixture below puts the stand-ins in their place)
REAL = {name: getattr(_wrapper, name) for name in ("fully_fused_projection", "spherical_harmonics", "isect_tiles",
                                                    "isect_offset_encode", "rasterize_to_pixels")}


def _args(name, args, kwargs) -> dict:
    """The call's arguments by name, as gsplat's wrapper `name` would take them (TypeError if it would not)."""
    bound = inspect.signature(REAL[name]).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _projection(*args, **kwargs):
    a = _args("fully_fused_projection", args, kwargs)
    assert a["packed"] and a["covars"] is None and a["radius_clip"] == 0.0
    covars, _ = ref._quat_scale_to_covar_preci(a["quats"], a["scales"], compute_preci=False)
    radii, means2d, depths, conics, comp = ref._fully_fused_projection(
        a["means"], covars, a["viewmats"], a["Ks"], a["width"], a["height"], a["eps2d"], a["near_plane"],
        a["far_plane"], a["calc_compensations"])
    cam, gid = torch.nonzero(radii > 0, as_tuple=True)  # packed: the visible (camera, Gaussian) pairs in order
    return (cam.int(), gid.int(), radii[cam, gid], means2d[cam, gid], depths[cam, gid], conics[cam, gid],
            None if comp is None else comp[cam, gid])


def _sh(*args, **kwargs):
    a = _args("spherical_harmonics", args, kwargs)
    assert a["masks"] is None
    return ref._spherical_harmonics(a["degrees_to_use"], a["dirs"], a["coeffs"])


def _isects(*args, **kwargs):
    a = _args("isect_tiles", args, kwargs)
    n = a["means2d"].shape[0]
    assert a["packed"] and a["n_cameras"] == 1 and not a["camera_ids"].any()
    assert torch.equal(a["gaussian_ids"], torch.arange(n))  # one camera: packed places are the unpacked ones
    return ref._isect_tiles(a["means2d"][None], a["radii"][None], a["depths"][None], a["tile_size"],
                            a["tile_width"], a["tile_height"], a["sort"])


def _offsets(*args, **kwargs):
    a = _args("isect_offset_encode", args, kwargs)
    return ref._isect_offset_encode(a["isect_ids"], a["n_cameras"], a["tile_width"], a["tile_height"])


def _raster(*args, **kwargs):
    """gsplat's per-pixel compositing (its kernel's rules: front to back over the tile's splats in the order of
    `flatten_ids`, alpha = min(0.999, opacity exp(-sigma)), skipped where sigma < 0 or alpha < 1/255, a pixel done
    before the splat that would take its transmittance to 1e-4 or below), written out in PyTorch per tile and
    splat: gsplat's own PyTorch rasterizer needs a CUDA kernel to find its pixels."""
    a = _args("rasterize_to_pixels", args, kwargs)
    assert a["packed"] and not a["absgrad"] and a["masks"] is None and a["backgrounds"] is None
    m2, conic, colors, opacity = a["means2d"], a["conics"], a["colors"], a["opacities"]
    width, height, tile = a["image_width"], a["image_height"], a["tile_size"]
    offsets, ids = a["isect_offsets"], a["flatten_ids"]
    assert offsets.shape[0] == 1  # one camera
    ends = torch.cat([offsets.flatten()[1:], torch.tensor([ids.numel()])])
    rows = []
    for ty in range(offsets.shape[1]):
        row = []
        for tx in range(offsets.shape[2]):
            ys, xs = torch.meshgrid(torch.arange(ty * tile, (ty + 1) * tile) + 0.5,
                                    torch.arange(tx * tile, (tx + 1) * tile) + 0.5, indexing="ij")
            T = torch.ones(ys.shape)
            out = torch.zeros(ys.shape + (colors.shape[1],))
            live = torch.ones(ys.shape, dtype=torch.bool)
            start, end = int(offsets[0, ty, tx]), int(ends[ty * offsets.shape[2] + tx])
            for g in ids[start:end].tolist():
                dx, dy = m2[g, 0] - xs, m2[g, 1] - ys
                sigma = 0.5 * (conic[g, 0] * dx * dx + conic[g, 2] * dy * dy) + conic[g, 1] * dx * dy
                alpha = torch.clamp_max(opacity[g] * torch.exp(-sigma), 0.999)
                use = live & (sigma >= 0) & (alpha >= 1.0 / 255.0)
                next_T = T * (1 - alpha)
                live = live & ~(use & (next_T <= 1e-4))
                use = use & live
                out = out + torch.where(use[..., None], colors[g] * (alpha * T)[..., None], 0.0)
                T = torch.where(use, next_T, T)
            row.append(torch.cat([out, (1 - T)[..., None]], dim=-1))
        rows.append(torch.cat(row, dim=1))
    image = torch.cat(rows, dim=0)[:height, :width]
    return image[None, ..., :-1], image[None, ..., -1:]


@pytest.fixture
def kernels(monkeypatch):
    for name, fake in (("fully_fused_projection", _projection), ("spherical_harmonics", _sh),
                       ("isect_tiles", _isects), ("isect_offset_encode", _offsets),
                       ("rasterize_to_pixels", _raster)):
        monkeypatch.setattr(_wrapper, name, fake)


def _project(s, mode, cuda: bool):
    p = leaves(s)
    cams = RowCameras(s["viewmat"][None], s["K"][None], torch.tensor([[float(W), float(H)]]))
    run = _project_cuda if cuda else project_splats
    ids, radii, splats = run(p["means"], p["quats"], p["log_scales"], p["logits"], p["coeffs"], cams, 3,
                             mode == "antialiased", 0.01, 1e10, 0.3)
    g = torch.Generator().manual_seed(5)
    (splats * torch.rand(splats.shape, generator=g)).sum().backward()
    return ids, radii, splats.detach(), {k: v.grad for k, v in p.items()}


@pytest.mark.parametrize("mode", ["antialiased", "classic"])
def test_the_owners_cuda_half_gives_the_cpu_halfs_splats(kernels, mode):
    s = scene(n=900)
    ids, radii, splats, grads = _project(s, mode, cuda=True)
    cpu_ids, cpu_radii, cpu_splats, cpu_grads = _project(s, mode, cuda=False)
    assert 100 < ids.numel() < 800  # visible and culled Gaussians both
    assert ids.dtype == cpu_ids.dtype == torch.int64 and radii.dtype == cpu_radii.dtype == torch.int32
    assert torch.equal(ids, cpu_ids) and torch.equal(radii, cpu_radii)
    for part in (MEANS2D, DEPTH, CONIC, OPACITY, RGB):
        torch.testing.assert_close(splats[:, part], cpu_splats[:, part], rtol=1e-4, atol=1e-5)
    for k, g in grads.items():
        torch.testing.assert_close(g, cpu_grads[k], rtol=1e-3, atol=1e-4 * float(cpu_grads[k].abs().max()))


def test_the_readers_cuda_half_gives_the_cpu_halfs_image(kernels):
    s = scene(n=900)
    _, radii, splats, _ = _project(s, "antialiased", cuda=False)
    out = {}
    for cuda in (True, False):
        leaf = splats.clone().requires_grad_()
        if cuda:
            render, alpha = _rasterize_cuda(leaf[:, MEANS2D], radii, leaf[:, DEPTH], leaf[:, CONIC], leaf[:, RGB],
                                            leaf[:, OPACITY], W, H, 16, False)
        else:
            render, alpha, _ = rasterize_splats(leaf, radii, W, H)
        loss_of(render, alpha).backward()
        out[cuda] = (render.detach(), alpha.detach(), leaf.grad)
    assert float(out[False][1].max()) > 0.5  # the splats cover the image
    for got, want in zip(out[True], out[False]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
