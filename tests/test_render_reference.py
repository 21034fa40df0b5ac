"""The CPU rasterizer (float32) against a brute-force float64 renderer written here, values and gradients.

The reference loops over nothing clever: per camera, every pixel against every visible Gaussian in one dense
[pixels, Gaussians] matrix, Gaussians sorted by depth, gsplat's rules applied literally (16x16 tile rectangle
from the integer radius, alpha = min(0.999, o exp(-power)), skip power < 0 or alpha < 1/255, stop before the
Gaussian that takes T to <= 1e-4, background, expected depth). Projection and SH come from gsplat's own PyTorch
reference (`gsplat.cuda._torch_impl`), run in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci, _spherical_harmonics

from odin_ns.render import rasterization

PARAMS = ("means", "quats", "scales", "opacities", "colors", "backgrounds")


pytestmark = pytest.mark.usefixtures("one_thread")


def make_scene(n=160, C=2, W=32, H=24, K=16, seed=0, D=None):
    """A dense little scene: big opaque splats (pixels reach T <= 1e-4) over small faint ones."""
    g = torch.Generator().manual_seed(seed)
    f = 0.9 * W
    z = torch.rand(n, generator=g) * 4 + 2
    x = (torch.rand(n, generator=g) * 2 - 1) * z * (W / 2 / f) * 1.1
    y = (torch.rand(n, generator=g) * 2 - 1) * z * (H / 2 / f) * 1.1
    big = torch.arange(n) % 2 == 0
    sig = torch.where(big, 2.0 + 3.0 * torch.rand(n, generator=g), 0.3 + torch.rand(n, generator=g))
    scales = (sig * z / f)[:, None] * torch.exp(torch.rand(n, 3, generator=g) - 0.5)
    opac = torch.where(big, 0.3 + 0.69 * torch.rand(n, generator=g), 0.05 + 0.5 * torch.rand(n, generator=g))
    colors = torch.randn(n, K, 3, generator=g) * 0.3 if D is None else torch.rand(n, D, generator=g)
    vms = []
    for c in range(C):
        a = 0.08 * c
        vm = torch.eye(4, dtype=torch.float64)
        vm[:3, :3] = torch.tensor([[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]])
        vm[:3, 3] = torch.tensor([0.1 * c, -0.05 * c, 0.2 * c])
        vms.append(vm)
    Ks = torch.tensor([[f, 0, W / 2], [0, f, H / 2], [0, 0, 1]], dtype=torch.float64).expand(C, 3, 3).clone()
    return dict(
        means=torch.stack([x, y, z], 1).double(), quats=torch.randn(n, 4, generator=g).double(),
        scales=scales.double(), opacities=opac.double(), colors=colors.double(), viewmats=torch.stack(vms),
        Ks=Ks, backgrounds=torch.rand(C, 3 if D is None else D, generator=g).double(), width=W, height=H,
    )


def reference(p, sh_degree, render_mode, rasterize_mode, tile_size=16):
    """Dense float64 renderer. Returns colors, alphas, means2d (with per-pixel leaves) and decision margins."""
    W, H = p["width"], p["height"]
    C = p["viewmats"].shape[0]
    covars, _ = _quat_scale_to_covar_preci(p["quats"], p["scales"], True, False, False)
    radii, m2, depths, conics, comps = _fully_fused_projection(
        p["means"], covars, p["viewmats"], p["Ks"], W, H, 0.3, 0.01, 1e10, rasterize_mode == "antialiased"
    )
    opac = p["opacities"].repeat(C, 1)
    if comps is not None:
        opac = opac * comps
    if sh_degree is None:
        cols = p["colors"].expand(C, -1, -1)
    else:
        dirs = p["means"][None] - torch.inverse(p["viewmats"])[:, None, :3, 3]
        cols = torch.clamp_min(_spherical_harmonics(sh_degree, dirs, p["colors"].expand(C, -1, -1, -1)) + 0.5, 0.0)
    bg = p.get("backgrounds")
    if render_mode in ("RGB+D", "RGB+ED"):
        cols = torch.cat([cols, depths[..., None]], -1)
        bg = None if bg is None else torch.cat([bg, bg.new_zeros(C, 1)], -1)
    elif render_mode in ("D", "ED"):
        cols = depths[..., None]
        bg = None if bg is None else bg.new_zeros(C, 1)

    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    px, py = xs.reshape(-1).double() + 0.5, ys.reshape(-1).double() + 0.5
    tw, th = math.ceil(W / tile_size), math.ceil(H / tile_size)
    # per-pixel additive zero leaves on means2d: their .grad is each pixel's own dL/dmeans2d (for absgrad)
    leaf = torch.zeros(C, H * W, p["means"].shape[0], 2, dtype=torch.float64, requires_grad=True)
    outs, alphas = [], []
    margins = dict(alpha=math.inf, stop=math.inf, clamp=math.inf, rect=math.inf)
    stats = dict(stopped=0, rect_clipped=0)
    for c in range(C):
        vis = (radii[c] > 0).nonzero().squeeze(1)
        order = vis[torch.sort(depths[c, vis].detach(), stable=True).indices]
        mx = m2[c, order, 0][None] + leaf[c][:, order, 0]
        my = m2[c, order, 1][None] + leaf[c][:, order, 1]
        a, b, cc = conics[c, order].unbind(-1)
        dx, dy = mx - px[:, None], my - py[:, None]
        power = 0.5 * (a * dx * dx + cc * dy * dy) + b * dx * dy
        ov = opac[c, order] * torch.exp(-power)
        alpha = ov.clamp_max(0.999)
        with torch.no_grad():
            r = radii[c, order].double() / tile_size
            t0x, t1x = m2[c, order, 0] / tile_size - r, m2[c, order, 0] / tile_size + r
            t0y, t1y = m2[c, order, 1] / tile_size - r, m2[c, order, 1] / tile_size + r
            rect_frac = torch.cat([t0x, t1x, t0y, t1y])
            margins["rect"] = min(margins["rect"], (rect_frac - rect_frac.round()).abs().min().item())
            x0 = torch.floor(t0x).clamp(0, tw) * tile_size
            x1 = torch.ceil(t1x).clamp(0, tw) * tile_size
            y0 = torch.floor(t0y).clamp(0, th) * tile_size
            y1 = torch.ceil(t1y).clamp(0, th) * tile_size
            inrect = (px[:, None] >= x0) & (px[:, None] < x1) & (py[:, None] >= y0) & (py[:, None] < y1)
            passes = (power >= 0) & (alpha >= 1 / 255)
            valid = inrect & passes
            Tc = torch.cumprod(1 - torch.where(valid, alpha, 0.0), 1)
            contrib = valid & (Tc > 1e-4)
            stats["stopped"] += int((valid & (Tc <= 1e-4)).any(1).sum())
            stats["rect_clipped"] += int((~inrect & passes).sum())
            margins["alpha"] = min(margins["alpha"], (ov * 255 - 1).abs().min().item())
            if valid.any():
                margins["stop"] = min(margins["stop"], torch.log(Tc[valid] / 1e-4).abs().min().item())
                margins["clamp"] = min(margins["clamp"], (ov[valid] - 0.999).abs().min().item())
        ac = torch.where(contrib, alpha, 0.0)
        Ti = torch.cumprod(1 - ac, 1)
        w = ac * torch.cat([torch.ones_like(Ti[:, :1]), Ti[:, :-1]], 1)
        Tf = Ti[:, -1:] if Ti.shape[1] else torch.ones(H * W, 1, dtype=torch.float64)
        out = w @ cols[c, order]
        if bg is not None:
            out = out + Tf * bg[c][None]
        outs.append(out.reshape(H, W, -1))
        alphas.append((1 - Tf).reshape(H, W, 1))
    rc, ra = torch.stack(outs), torch.stack(alphas)
    if render_mode in ("ED", "RGB+ED"):
        rc = torch.cat([rc[..., :-1], rc[..., -1:] / ra.clamp(min=1e-10)], -1)
    return rc, ra, m2, radii, leaf, margins, stats


def leaves(p, dtype, with_bg=True):
    out = {}
    for k, v in p.items():
        if k == "backgrounds" and not with_bg:
            continue
        if torch.is_tensor(v):
            v = v.to(dtype).clone()
            if k in PARAMS:
                v.requires_grad_()
        out[k] = v
    return out


CASES = [
    # sh_degree, render_mode, rasterize_mode, backgrounds, packed, cameras, tile_size
    (3, "RGB+ED", "classic", True, False, 2, 16),
    (0, "RGB", "antialiased", False, False, 1, 16),
    (1, "RGB+ED", "antialiased", True, True, 3, 16),
    (2, "ED", "classic", True, False, 1, 8),
    (None, "RGB+D", "classic", True, False, 2, 8),
]


@pytest.mark.parametrize("sh_degree,render_mode,rasterize_mode,with_bg,packed,C,tile_size", CASES)
def test_values_and_gradients_match_float64_reference(
    sh_degree, render_mode, rasterize_mode, with_bg, packed, C, tile_size
):
    p = make_scene(C=C, seed=4, D=None if sh_degree is not None else 2)
    ref = leaves(p, torch.float64, with_bg)
    rc, ra, m2, radii, leaf, margins, stats = reference(ref, sh_degree, render_mode, rasterize_mode, tile_size)
    # The float32 path must take the same discrete decisions as float64, so every decision must sit farther
    # from its threshold than float32 rounding can move it: o exp(-power) has relative error ~|power| * 1e-7
    # (power <= ~7 where alpha crosses 1/255), T after ~100 factors ~1e-5 relative, radius / 16 ~1e-6.
    assert margins["alpha"] > 4e-6 and margins["stop"] > 5e-5 and margins["clamp"] > 1e-5, margins
    assert margins["rect"] > 1e-5, margins
    # ... and the scene exercises early termination (see also test_scene_exercises_tile_cut)
    assert stats["stopped"] > 20, stats

    fast = leaves(p, torch.float32, with_bg)
    oc, oa, meta = rasterization(
        fast["means"], fast["quats"], fast["scales"], fast["opacities"], fast["colors"], fast["viewmats"],
        fast["Ks"], p["width"], p["height"], sh_degree=sh_degree, backgrounds=fast.get("backgrounds"),
        render_mode=render_mode, rasterize_mode=rasterize_mode, packed=packed, absgrad=True, tile_size=tile_size,
    )
    assert oc.dtype == torch.float32 and oc.shape == rc.shape and oa.shape == ra.shape
    if packed:
        assert torch.equal(meta["radii"], radii[radii > 0].int())
    else:
        assert torch.equal(meta["radii"], radii.int())

    # Values: float32 storage of O(1) colors and depths (2-6) composited over up to ~100 layers; observed
    # errors are ~1e-6 on colors and ~4e-6 on expected depth, so these bounds keep a ~10x margin.
    torch.testing.assert_close(oa.double(), ra, rtol=0, atol=1e-5)
    torch.testing.assert_close(oc.double(), rc, rtol=1e-5, atol=2e-5)

    g = torch.Generator().manual_seed(7)
    wc = torch.randn(rc.shape, generator=g, dtype=torch.float64)
    wa = torch.randn(ra.shape, generator=g, dtype=torch.float64)
    m2.retain_grad()
    ((rc * wc).sum() + (ra * wa).sum()).backward()
    meta["means2d"].retain_grad()
    ((oc * wc.float()).sum() + (oa * wa.float()).sum()).backward()

    # Gradients: sums over hundreds of pixels and the 2D->3D chain rule in float32; observed errors are
    # <= 2e-6 of each tensor's largest entry, bound at 5e-5 of it (plus 1e-4 relative).
    def close(actual, expected, what):
        tol = 5e-5 * expected.abs().max().item() + 1e-12
        torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=tol, msg=lambda m: f"{what}: {m}")

    for k in PARAMS:
        if k not in ref:
            continue
        if ref[k].grad is None:
            assert fast[k].grad is None or not fast[k].grad.any(), k
            continue
        assert ref[k].grad.abs().max() > 0, k
        close(fast[k].grad, ref[k].grad, k)
    ref_m2_grad = m2.grad
    ref_abs = leaf.grad.abs().sum(1)  # sum over pixels of |per-pixel dL/dmeans2d|, [C, N, 2]
    if packed:
        sel = radii > 0
        ref_m2_grad, ref_abs = ref_m2_grad[sel], ref_abs[sel]
    close(meta["means2d"].grad, ref_m2_grad, "means2d.grad")
    close(meta["means2d"].absgrad, ref_abs, "means2d.absgrad")
    # absgrad is a sum of magnitudes: it dominates the signed gradient and differs from it somewhere
    assert (meta["means2d"].absgrad >= meta["means2d"].grad.abs() - 1e-5).all()
    assert (ref_abs - ref_m2_grad.abs()).max() > 1e-3


def test_scene_exercises_tile_cut():
    """Some pixels pass alpha >= 1/255 outside gsplat's tile rectangle: the comparisons above check that cut."""
    p = make_scene(C=2, seed=4)
    *_, stats = reference(leaves(p, torch.float64), 3, "RGB", "classic", 16)
    assert stats["rect_clipped"] > 0 and stats["stopped"] > 20, stats


def test_background_only_pixels_and_empty_scene():
    p = make_scene(n=0, C=2)
    fast = leaves(p, torch.float32)
    oc, oa, meta = rasterization(
        fast["means"], fast["quats"], fast["scales"], fast["opacities"], fast["colors"], fast["viewmats"],
        fast["Ks"], p["width"], p["height"], sh_degree=3, backgrounds=fast["backgrounds"], packed=False,
    )
    assert torch.equal(oa, torch.zeros_like(oa))
    assert torch.equal(oc, fast["backgrounds"][:, None, None, :].expand_as(oc))
    oc.sum().backward()
    torch.testing.assert_close(fast["backgrounds"].grad, torch.full_like(fast["backgrounds"], p["width"] * p["height"]))
