"""The CUDA halves' calls into gsplat's kernels (`render/splats.py`), run on the CPU with gsplat's own PyTorch
references (`gsplat.cuda._torch_impl`) standing in for the kernels, through the public halves (`project_splats`,
`rasterize_splats`) with their CUDA branch taken. Each stand-in of a wrapper first binds its arguments to the
wrapper's own signature (a wrong name, order or count fails here, not on a GPU) and checks the dtypes its kernel
reads, then computes what the wrapper documents for the packed layout; the rasterization keeps gsplat's own wrapper
(its asserts, channel padding and `.contiguous()` copies) and stands in for its autograd function only, whose
backward puts `absgrad` on the `means2d` it was given, as gsplat's does. What the glue does around the calls (ids
and radii types, the colours' offset, the camera's position, the compensation, the tiles' offsets, the expected
depth's channel, the absolute gradients' tensor) must give the CPU path's splats, image and gradients. The kernels
themselves are checked on a GPU (`tests/test_cuda.py`).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from gsplat.cuda import _torch_impl as ref
from gsplat.cuda import _wrapper

from odin_ns.render import splats as halves
from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import CONIC, DEPTH, MEANS2D, OPACITY, RGB, project_splats, rasterize_splats
from test_render_splats import H, W, leaves, loss_of, scene


# the kernels' wrappers, as gsplat defines them (the fixture below puts the stand-ins in their place)
REAL = {name: getattr(_wrapper, name) for name in ("fully_fused_projection", "spherical_harmonics", "isect_tiles",
                                                    "isect_offset_encode")}


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
    cam, gid = torch.nonzero(radii > 0, as_tuple=True)  # packed: the visible (camera, Gaussian) pairs in order,
    # their ids int64 and radii int32, as the packed kernel returns them
    return (cam, gid, radii[cam, gid].int(), means2d[cam, gid], depths[cam, gid], conics[cam, gid],
            None if comp is None else comp[cam, gid])


def _sh(*args, **kwargs):
    a = _args("spherical_harmonics", args, kwargs)
    assert a["masks"] is None
    return ref._spherical_harmonics(a["degrees_to_use"], a["dirs"], a["coeffs"])


def _isects(*args, **kwargs):
    a = _args("isect_tiles", args, kwargs)
    n = a["means2d"].shape[0]
    assert a["packed"] and a["n_cameras"] == 1 and not a["camera_ids"].any()
    # the kernel reads the ids as int64 and the radii as int32
    assert a["camera_ids"].dtype == a["gaussian_ids"].dtype == torch.int64 and a["radii"].dtype == torch.int32
    assert torch.equal(a["gaussian_ids"], torch.arange(n))  # one camera: packed places are the unpacked ones
    return ref._isect_tiles(a["means2d"][None], a["radii"][None], a["depths"][None], a["tile_size"],
                            a["tile_width"], a["tile_height"], a["sort"])


def _offsets(*args, **kwargs):
    a = _args("isect_offset_encode", args, kwargs)
    return ref._isect_offset_encode(a["isect_ids"], a["n_cameras"], a["tile_width"], a["tile_height"])


def _composite(m2, conic, colors, opacity, width, height, tile, offsets, ids):
    """gsplat's per-pixel compositing (its kernel's rules: front to back over the tile's splats in the order of
    `flatten_ids`, alpha = min(0.999, opacity exp(-sigma)), skipped where sigma < 0 or alpha < 1/255, a pixel done
    before the splat that would take its transmittance to 1e-4 or below), written out in PyTorch per tile and
    splat: gsplat's own PyTorch rasterizer needs a CUDA kernel to find its pixels."""
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


class _Rasterize(torch.autograd.Function):
    """Stands in for gsplat's `_RasterizeToPixels` (the same arguments, packed), with `_composite` for its kernels;
    its backward, as gsplat's, puts the absolute gradients on the `means2d` it was given (here the gradient's
    absolute value: what matters is which tensor gets them)."""

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, masks, width, height, tile_size,
                isect_offsets, flatten_ids, absgrad):
        assert backgrounds is None and masks is None
        assert all(t.is_contiguous() for t in (means2d, conics, colors, opacities))  # the wrapper's copies
        inputs = [t.detach().requires_grad_() for t in (means2d, conics, colors, opacities)]
        with torch.enable_grad():
            outputs = _composite(*inputs, width, height, tile_size, isect_offsets, flatten_ids)
        ctx.save_for_backward(means2d)
        ctx.graph, ctx.absgrad = (inputs, outputs), absgrad
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, v_colors, v_alphas):
        inputs, outputs = ctx.graph
        grads = torch.autograd.grad(outputs, inputs, (v_colors, v_alphas), allow_unused=True)
        (means2d,) = ctx.saved_tensors
        if ctx.absgrad:
            means2d.absgrad = grads[0].abs()
        return (*grads, None, None, None, None, None, None, None, None)


@pytest.fixture
def kernels(monkeypatch):
    """gsplat's kernels stood in for; the halves take their CUDA branch only while `cuda` is set."""
    for name, fake in (("fully_fused_projection", _projection), ("spherical_harmonics", _sh),
                       ("isect_tiles", _isects), ("isect_offset_encode", _offsets),
                       ("_RasterizeToPixels", _Rasterize)):
        monkeypatch.setattr(_wrapper, name, fake)
    branch = {"cuda": False}
    monkeypatch.setattr(halves, "_gsplat_kernels", lambda t: branch["cuda"])
    return branch


def _project(s, mode, kernels, cuda: bool):
    p = leaves(s)
    cams = RowCameras(s["viewmat"][None], s["K"][None], torch.tensor([[float(W), float(H)]]))
    kernels["cuda"] = cuda
    ids, radii, splats = project_splats(p["means"], p["quats"], p["log_scales"], p["logits"], p["coeffs"], cams, 3,
                                        mode == "antialiased", 0.01, 1e10, 0.3)
    g = torch.Generator().manual_seed(5)
    (splats * torch.rand(splats.shape, generator=g)).sum().backward()
    return ids, radii, splats.detach(), {k: v.grad for k, v in p.items()}


@pytest.mark.parametrize("mode", ["antialiased", "classic"])
def test_the_owners_cuda_half_gives_the_cpu_halfs_splats(kernels, mode):
    s = scene(n=900)
    ids, radii, splats, grads = _project(s, mode, kernels, cuda=True)
    cpu_ids, cpu_radii, cpu_splats, cpu_grads = _project(s, mode, kernels, cuda=False)
    assert 100 < ids.numel() < 800  # visible and culled Gaussians both
    assert ids.dtype == cpu_ids.dtype == torch.int64 and radii.dtype == cpu_radii.dtype == torch.int32
    assert torch.equal(ids, cpu_ids) and torch.equal(radii, cpu_radii)
    for part in (MEANS2D, DEPTH, CONIC, OPACITY, RGB):
        torch.testing.assert_close(splats[:, part], cpu_splats[:, part], rtol=1e-4, atol=1e-5)
    for k, g in grads.items():
        torch.testing.assert_close(g, cpu_grads[k], rtol=1e-3, atol=1e-4 * float(cpu_grads[k].abs().max()))


@pytest.mark.parametrize("render_mode,absgrad", [("RGB", True), ("RGB+ED", False)])
def test_the_readers_cuda_half_gives_the_cpu_halfs_image(kernels, render_mode, absgrad):
    s = scene(n=900)
    _, radii, splats, _ = _project(s, "antialiased", kernels, cuda=False)
    out = {}
    for cuda in (True, False):
        kernels["cuda"] = cuda
        leaf = splats.clone().requires_grad_()
        render, alpha, means2d = rasterize_splats(leaf, radii, W, H, render_mode, absgrad)
        loss_of(render, alpha).backward()
        out[cuda] = (render.detach(), alpha.detach(), leaf.grad)
        if absgrad:  # on the tensor handed back, as the strategy's statistics read it (`SplatReader.after_backward`)
            assert means2d.absgrad.shape == (leaf.shape[0], 2)
            if cuda:
                assert torch.equal(means2d.absgrad, leaf.grad[:, MEANS2D].abs())
    assert float(out[False][1].max()) > 0.5  # the splats cover the image
    assert out[True][0].shape[-1] == (4 if render_mode == "RGB+ED" else 3)
    for got, want in zip(out[True], out[False]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
