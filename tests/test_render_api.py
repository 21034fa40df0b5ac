"""The renderer's public contract: gsplat's signature, CUDA dispatch, the meta a densification strategy reads."""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
from gsplat.rendering import rasterization as gsplat_rasterization
from gsplat.strategy import DefaultStrategy

import odin_ns.render as render
from odin_ns.render import rasterization


pytestmark = pytest.mark.usefixtures("one_thread")


def small(n=200, W=32, H=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = 2 + 3 * torch.rand(n, generator=g)
    xy = (torch.rand(n, 2, generator=g) * 2 - 1) * z[:, None] * 0.5
    return dict(
        means=torch.nn.Parameter(torch.cat([xy, z[:, None]], 1)),
        quats=torch.nn.Parameter(torch.randn(n, 4, generator=g)),
        scales=torch.nn.Parameter(torch.log(0.02 + 0.05 * torch.rand(n, 3, generator=g))),
        opacities=torch.nn.Parameter(torch.logit(0.1 + 0.8 * torch.rand(n, generator=g))),
        sh0=torch.nn.Parameter(0.3 * torch.randn(n, 1, 3, generator=g)),
        shN=torch.nn.Parameter(0.1 * torch.randn(n, 15, 3, generator=g)),
    ), W, H


def cam(W, H):
    return torch.eye(4)[None], torch.tensor([[[30.0, 0, W / 2], [0, 30.0, H / 2], [0, 0, 1]]])


def test_signature_is_gsplats():
    ours = inspect.signature(rasterization).parameters
    theirs = inspect.signature(gsplat_rasterization).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert ours[name].default == p.default, name
        assert ours[name].kind == p.kind, name


def test_cuda_tensors_go_to_gsplat_unchanged():
    means = mock.MagicMock(is_cuda=True)
    with mock.patch("gsplat.rendering.rasterization", return_value="gsplat") as g:
        out = rasterization(means, "q", "s", "o", "c", "v", "K", 10, 20, render_mode="RGB+ED", absgrad=True)
    assert out == "gsplat"
    kwargs = g.call_args.kwargs
    assert kwargs["means"] is means and kwargs["render_mode"] == "RGB+ED" and kwargs["absgrad"] is True
    assert kwargs["packed"] is True and kwargs["tile_size"] == 16 and kwargs["eps2d"] == 0.3
    assert set(kwargs) == set(inspect.signature(gsplat_rasterization).parameters)


@pytest.mark.parametrize(
    "kw,match",
    [(dict(distributed=True), "distributed"), (dict(camera_model="ortho"), "camera_model"),
     (dict(packed=True, sparse_grad=True), "sparse_grad")],
)
def test_unsupported_options_raise_clearly(kw, match):
    params, W, H = small(20)
    vm, K = cam(W, H)
    with pytest.raises(NotImplementedError, match=match):
        rasterization(params["means"], params["quats"], params["scales"].exp(), params["opacities"].sigmoid(),
                      torch.cat([params["sh0"], params["shN"]], 1), vm, K, W, H, sh_degree=3, **kw)


@pytest.mark.parametrize("absgrad", [False, True])
def test_default_strategy_reads_our_meta(absgrad):
    """gsplat's DefaultStrategy consumes the CPU meta as it consumes gsplat's (splatfacto's training step)."""
    params, W, H = small()
    pd = torch.nn.ParameterDict(params)
    optimizers = {k: torch.optim.Adam([v], lr=1e-3) for k, v in pd.items()}
    strategy = DefaultStrategy(absgrad=absgrad, refine_start_iter=0, refine_every=2, reset_every=1000,
                               verbose=False)
    strategy.check_sanity(pd, optimizers)
    state = strategy.initialize_state()
    vm, K = cam(W, H)
    for step in range(2):
        rc, ra, info = rasterization(
            pd["means"], pd["quats"], pd["scales"].exp(), pd["opacities"].sigmoid(),
            torch.cat([pd["sh0"], pd["shN"]], 1), vm, K, W, H, sh_degree=3, packed=False, absgrad=absgrad,
            render_mode="RGB+ED",
        )
        strategy.step_pre_backward(pd, optimizers, state, step, info)
        (rc[..., :3].mean() + ra.mean()).backward()
        g = (info["means2d"].absgrad if absgrad else info["means2d"].grad).clone()
        sel = info["radii"][0] > 0
        n_before = len(pd["means"])
        strategy.step_post_backward(pd, optimizers, state, step, info, packed=False)
        if step == 0:
            g[..., 0] *= W / 2.0
            g[..., 1] *= H / 2.0
            expected = torch.zeros(n_before)
            expected[sel] = g[0, sel].norm(dim=-1)
            torch.testing.assert_close(state["grad2d"], expected)
            torch.testing.assert_close(state["count"], sel.float())
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad()
    assert state["grad2d"] is not None and len(pd["means"]) >= 1


def test_public_names():
    assert render.rasterization is rasterization
    assert callable(render.rasterization_cpu)
