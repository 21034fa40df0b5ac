"""torch.autograd.gradcheck (float64) of the CPU rasterizer: the hand-written compositing backward and the whole
pipeline (projection + SH + compositing) against finite differences of its own forward.

Finite differences only make sense where no discrete decision flips under a 1e-6 perturbation, so each scene is
checked first: alpha vs 1/255, o exp(-power) vs the 0.999 clamp, T vs 1e-4, 3 sigma vs its integer radius and the
16x16 tile rectangle all keep a margin.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from odin_ns.render import rasterization
from odin_ns.render.composite import RasterizeToPixelsCPU
from odin_ns.render.tiles import TileGrid, build_isects

W, H = 12, 8


pytestmark = pytest.mark.usefixtures("one_thread")


def projected(outputs, k=6, seed=0):
    """k fixed random linear combinations of all outputs: gradcheck then needs k backward passes, not one per
    output element, and still compares every input's gradient (J^T v for k random v)."""
    flat = torch.cat([o.reshape(-1) for o in outputs])
    R = torch.randn(flat.numel(), k, generator=torch.Generator().manual_seed(seed), dtype=flat.dtype)
    return flat @ R


def tiny_scene(n=7, C=2, seed=0, K=4):
    g = torch.Generator().manual_seed(seed)
    f = 10.0
    z = 2.0 + 2.0 * torch.rand(n, generator=g, dtype=torch.float64)
    xy = (torch.rand(n, 2, generator=g, dtype=torch.float64) * 2 - 1) * z[:, None] * torch.tensor([0.5, 0.35])
    vms = torch.eye(4, dtype=torch.float64).repeat(C, 1, 1)
    vms[1:, 0, 3] = 0.15
    return dict(
        means=torch.cat([xy, z[:, None]], 1),
        quats=torch.randn(n, 4, generator=g, dtype=torch.float64),
        scales=(0.08 + 0.2 * torch.rand(n, 3, generator=g, dtype=torch.float64)),
        opacities=0.2 + 0.7 * torch.rand(n, generator=g, dtype=torch.float64),
        colors=0.3 * torch.randn(n, K, 3, generator=g, dtype=torch.float64),
        backgrounds=torch.rand(C, 3, generator=g, dtype=torch.float64),
        viewmats=vms,
        Ks=torch.tensor([[f, 0, W / 2], [0, f, H / 2], [0, 0, 1]], dtype=torch.float64).repeat(C, 1, 1),
    )


def decision_margins(meta, tile_size=16):
    """Smallest relative distance of any per-pixel decision to its threshold (float64 recomputation)."""
    m2, con, op, radii = meta["means2d"].detach(), meta["conics"].detach(), meta["opacities"].detach(), meta["radii"]
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    px, py = xs.reshape(-1, 1) + 0.5, ys.reshape(-1, 1) + 0.5
    out = dict(alpha=math.inf, clamp=math.inf, stop=math.inf, rect=math.inf)
    stopped = 0
    for c in range(m2.shape[0]):
        vis = (radii[c] > 0).nonzero().squeeze(1)
        order = vis[torch.sort(meta["depths"][c, vis].detach(), stable=True).indices]
        a, b, cc = con[c, order].unbind(1)
        dx, dy = m2[c, order, 0] - px, m2[c, order, 1] - py
        ov = op[c, order] * torch.exp(-(0.5 * (a * dx * dx + cc * dy * dy) + b * dx * dy))
        out["alpha"] = min(out["alpha"], (ov * 255 - 1).abs().min().item())
        out["clamp"] = min(out["clamp"], (ov - 0.999).abs().min().item())
        T = torch.cumprod(1 - torch.where(ov >= 1 / 255, ov.clamp_max(0.999), 0.0), 1)
        out["stop"] = min(out["stop"], (torch.log(T / 1e-4)).abs().min().item())
        stopped += int((T <= 1e-4).any(1).sum())
        r = radii[c, order].double()
        edges = torch.cat([(m2[c, order, i] + sgn * r) / tile_size for i in (0, 1) for sgn in (-1, 1)])
        out["rect"] = min(out["rect"], (edges - edges.round()).abs().min().item())
    return out, stopped


def test_gradcheck_full_pipeline():
    s = tiny_scene()
    names = ("means", "quats", "scales", "opacities", "colors", "backgrounds")
    inputs = tuple(s[k].clone().requires_grad_() for k in names)

    def f(means, quats, scales, opacities, colors, backgrounds):
        rc, ra, meta = rasterization(
            means, quats, scales, opacities, colors, s["viewmats"], s["Ks"], W, H, sh_degree=1,
            backgrounds=backgrounds, render_mode="RGB+ED", packed=False,
        )
        f.meta = meta
        return projected((rc, ra))

    f(*inputs)
    assert f.meta["means2d"].dtype == torch.float64
    assert (f.meta["radii"] > 0).sum() >= 10
    m, _ = decision_margins(f.meta)
    assert min(m.values()) > 1e-4, m
    assert gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, check_batched_grad=False)


def test_gradcheck_compositing_with_termination():
    """The hand-written backward alone, on a deep pile (pixels stop at T <= 1e-4), with backgrounds."""
    g = torch.Generator().manual_seed(1)
    C, N, D = 1, 80, 3
    means2d = torch.rand(C, N, 2, generator=g, dtype=torch.float64) * torch.tensor([W, H])
    A = torch.randn(C, N, 2, 2, generator=g, dtype=torch.float64) * 2.5
    cov = A @ A.transpose(-1, -2) + 0.8 * torch.eye(2, dtype=torch.float64)
    inv = torch.linalg.inv(cov)
    conics = torch.stack([inv[..., 0, 0], inv[..., 0, 1], inv[..., 1, 1]], -1)
    opac = 0.4 + 0.55 * torch.rand(C, N, generator=g, dtype=torch.float64)
    colors = torch.rand(C, N, D, generator=g, dtype=torch.float64)
    bg = torch.rand(C, D, generator=g, dtype=torch.float64)
    depths = torch.rand(C, N, generator=g, dtype=torch.float64) + 1
    radii = torch.full((C, N), 12, dtype=torch.int32)
    grid = TileGrid(C, W, H, 4)
    isects = build_isects(grid, means2d.view(-1, 2), conics.view(-1, 3), opac.view(-1), depths.view(-1),
                          radii.view(-1), torch.zeros(N, dtype=torch.long), 16)

    def f(m, c, col, o, b):
        return projected(RasterizeToPixelsCPU.apply(m.view(-1, 2), c.view(-1, 3), col.view(-1, D), o.view(-1), b,
                                                    isects, 8, False, None))

    meta = dict(means2d=means2d, conics=conics, opacities=opac, radii=radii, depths=depths)
    m, stopped = decision_margins(meta)
    assert m["alpha"] > 1e-4 and m["clamp"] > 1e-4 and m["stop"] > 1e-4, m
    assert stopped > 0.2 * W * H  # many pixels reach the stop rule
    inputs = tuple(t.clone().requires_grad_() for t in (means2d, conics, colors, opac, bg))
    assert gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, check_batched_grad=False)
