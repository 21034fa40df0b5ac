"""The renderer cut in two (owners project, the reader rasterizes) is the whole renderer, bit for bit, whatever the
partition of the Gaussians among owners and the order their splats arrive in."""

from __future__ import annotations

import math

import pytest
import torch

from odin_ns.render import rasterization_cpu
from odin_ns.render.projection import RowCameras, partition_free
from odin_ns.render.splats import SPLAT_WIDTH, project_splats, rasterize_splats

W, H = 64, 48


def scene(n=2500, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.rand(n, generator=g) * 6 + 1
    xy = (torch.rand(n, 2, generator=g) * 2 - 1) * z[:, None] * 1.2  # some off screen
    a = 0.2
    vm = torch.eye(4)
    vm[:3, :3] = torch.tensor([[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]])
    vm[:3, 3] = torch.tensor([0.3, -0.1, 0.2])
    return dict(means=torch.cat([xy, z[:, None]], 1), quats=torch.randn(n, 4, generator=g),
                log_scales=torch.rand(n, 3, generator=g).log() * 0.7 - 3.0,
                logits=torch.randn(n, 1, generator=g) * 2, coeffs=torch.randn(n, 16, 3, generator=g) * 0.4,
                viewmat=vm, K=torch.tensor([[50.0, 0, W / 2], [0, 50.0, H / 2], [0, 0, 1]]))


def loss_of(render, alpha):
    g = torch.Generator().manual_seed(3)
    return (render * torch.rand(render.shape, generator=g)).sum() + (alpha * torch.rand(alpha.shape, generator=g)).sum()


def leaves(s, rows=None):
    keys = ("means", "quats", "log_scales", "logits", "coeffs")
    return {k: (s[k] if rows is None else s[k][rows]).clone().requires_grad_() for k in keys}


@pytest.mark.parametrize("mode,render_mode", [("antialiased", "RGB"), ("classic", "RGB+ED")])
def test_owners_projections_rasterized_together_are_the_whole_render(mode, render_mode):
    s = scene()
    n = s["means"].shape[0]
    full = leaves(s)
    render, alpha, meta = rasterization_cpu(
        full["means"], full["quats"], partition_free(torch.exp, full["log_scales"]),
        partition_free(torch.sigmoid, full["logits"]).squeeze(-1), full["coeffs"], s["viewmat"][None], s["K"][None],
        W, H, sh_degree=3, packed=False, render_mode=render_mode, absgrad=True, rasterize_mode=mode)
    meta["means2d"].retain_grad()  # as gsplat's strategy does
    loss_of(render, alpha).backward()
    visible = meta["radii"][0] > 0
    assert 100 < int(visible.sum()) < n - 100  # visible and culled Gaussians both

    # three owners: uneven runs of rows, their splats arriving in another order, put back in global order
    cuts = [0, 7, 1601, n]
    owners = [leaves(s, torch.arange(a, b)) for a, b in zip(cuts, cuts[1:])]
    parts = []
    for (a, _), p in zip(zip(cuts, cuts[1:]), owners):
        ids, radii, splats = project_splats(p["means"], p["quats"], p["log_scales"], p["logits"], p["coeffs"],
                                            RowCameras.one(s["viewmat"], s["K"], W, H), 3, mode == "antialiased")
        assert splats.shape == (ids.shape[0], SPLAT_WIDTH)
        parts.append((ids + a, radii, splats))
    arrived = [parts[2], parts[0], parts[1]]
    keys = torch.cat([p[0] for p in arrived])
    received = [p[2].detach().requires_grad_() for p in arrived]
    order = torch.argsort(keys)
    splats = torch.cat(received)[order]
    render2, alpha2, m2 = rasterize_splats(splats, torch.cat([p[1] for p in arrived])[order], W, H, render_mode,
                                           absgrad=True)
    assert torch.equal(render2, render) and torch.equal(alpha2, alpha)
    loss_of(render2, alpha2).backward()
    # the splats' gradients go back to their owners, who finish the backward through their projection
    for (ids, _, projected), r in zip(arrived, received):
        projected.backward(r.grad)
    for k, ref in full.items():
        got = torch.cat([p[k].grad for p in owners])
        assert torch.equal(got, ref.grad), k
    # the screen-space gradients the densification statistics read
    assert torch.equal(torch.cat([r.grad for r in received])[order][:, :2], meta["means2d"].grad[0][visible])
    assert torch.equal(m2.absgrad, meta["means2d"].absgrad[0][visible])


def test_no_visible_splat_renders_background_only():
    s = scene(50)
    s["means"][:, 2] = -5.0  # all behind the camera
    p = leaves(s)
    ids, radii, splats = project_splats(p["means"], p["quats"], p["log_scales"], p["logits"], p["coeffs"],
                                        RowCameras.one(s["viewmat"], s["K"], W, H), 3, True)
    assert ids.numel() == 0 and splats.shape == (0, SPLAT_WIDTH)
    render, alpha, _ = rasterize_splats(splats, radii, W, H)
    assert not render.any() and not alpha.any()


def test_an_owner_projects_several_views_in_one_call_as_one_call_each():
    """Owners project every view that reads their blocks at a step in one call (one camera per row): the splats
    and the gradients are those of a call per view."""
    s = scene(400)
    vm2 = s["viewmat"].clone()
    vm2[:3, 3] += torch.tensor([0.5, 0.2, -0.3])
    views = [(s["viewmat"], torch.arange(0, 300)), (vm2, torch.arange(100, 400))]
    g = torch.Generator().manual_seed(5)
    alone, grads_alone = [], []
    for vm, rows in views:
        p = leaves(s, rows)
        ids, radii, splats = project_splats(p["means"], p["quats"], p["log_scales"], p["logits"], p["coeffs"],
                                            RowCameras.one(vm, s["K"], W, H), 3, True)
        up = torch.rand(splats.shape, generator=g)
        splats.backward(up)
        alone.append((ids, radii, splats.detach(), up))
        grads_alone.append(torch.cat([p[k].grad.flatten(1) for k in p], 1))
    rows = torch.cat([r for _, r in views])
    p = leaves(s, rows)
    which = torch.repeat_interleave(torch.arange(2), torch.tensor([300, 300]))
    cams = RowCameras(torch.stack([vm for vm, _ in views])[which], s["K"].expand(600, 3, 3),
                      torch.tensor([[float(W), float(H)]]).expand(600, 2))
    ids, radii, splats = project_splats(p["means"], p["quats"], p["log_scales"], p["logits"], p["coeffs"], cams, 3,
                                        True)
    n0 = alone[0][0].shape[0]
    assert torch.equal(ids, torch.cat([alone[0][0], alone[1][0] + 300]))
    assert torch.equal(radii, torch.cat([alone[0][1], alone[1][1]]))
    assert torch.equal(splats.detach(), torch.cat([alone[0][2], alone[1][2]]))
    splats.backward(torch.cat([alone[0][3], alone[1][3]]))
    together = torch.cat([p[k].grad.flatten(1) for k in p], 1)
    assert n0 > 50 and torch.equal(together, torch.cat(grads_alone))


def test_a_projection_of_several_views_gives_every_parameter_its_gradient_in_one_call_or_one_per_view():
    """What an owner keeps for its backward (`project_views`): one call with a camera per row (CPU), or a call per
    view on slices of the same leaves (gsplat's kernels on CUDA take one camera); the same splats and the same
    contribution to every row's every parameter, none lost to a copy of the leaves."""
    from odin_ns.runtime.sharded import pack_params, param_columns
    from odin_ns.runtime.view_projection import backprop, project_views

    s = scene(400)
    vm2 = s["viewmat"].clone()
    vm2[:3, 3] += torch.tensor([0.5, 0.2, -0.3])
    rows = torch.cat([torch.arange(0, 300), torch.arange(100, 400)])
    params = {"means": s["means"], "scales": s["log_scales"], "quats": s["quats"], "features_dc": s["coeffs"][:, 0],
              "features_rest": s["coeffs"][:, 1:], "opacities": s["logits"]}
    packed = pack_params(params)[rows]
    cams = [(s["viewmat"], s["K"], W, H), (vm2, s["K"], W, H)]
    out = []
    for per_call in (False, True):
        proj, run = project_views(packed, 15, cams, [300, 300], 3, True, per_call=per_call)
        grads = torch.rand(proj.splats.shape, generator=torch.Generator().manual_seed(7))
        norm2d = torch.rand(proj.splats.shape[0], generator=torch.Generator().manual_seed(8))
        out.append((proj.ids, proj.radii, proj.splats.detach(), run, backprop(proj, grads, norm2d)))
    (ids, radii, splats, run, one), (ids2, radii2, splats2, run2, each) = out
    assert torch.equal(ids, ids2) and torch.equal(radii, radii2) and torch.equal(splats, splats2)
    assert torch.equal(run, run2) and int((radii > 0).sum()) > 100
    for c0, c1 in param_columns(15).values():  # every parameter got a gradient, on both paths
        assert bool((one[:, c0:c1] != 0).any()) and bool((each[:, c0:c1] != 0).any())
    assert torch.equal(one, each)
