"""Projection, SH colors and culling of the CPU rasterizer against gsplat's PyTorch reference (`_torch_impl`)."""

from __future__ import annotations

import math

import pytest
import torch
from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci, _spherical_harmonics

from odin_ns.render import rasterization
from odin_ns.render.sh import sh_colors

W, H = 40, 30


pytestmark = pytest.mark.usefixtures("one_thread")


def scene(n=300, C=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = 30.0
    z = torch.rand(n, generator=g) * 6 + 1
    xy = (torch.rand(n, 2, generator=g) * 2 - 1) * z[:, None] * 0.9  # some well outside the 1.3x fov
    vms = torch.eye(4).repeat(C, 1, 1)
    for c in range(C):
        a = 0.1 * c
        vms[c, :3, :3] = torch.tensor([[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]])
        vms[c, :3, 3] = torch.tensor([0.2 * c, 0.0, 0.1 * c])
    return dict(
        means=torch.cat([xy, z[:, None]], 1),
        quats=torch.randn(n, 4, generator=g),
        scales=torch.rand(n, 3, generator=g) * 0.15 + 0.005,
        opacities=torch.rand(n, generator=g),
        colors=torch.randn(n, 16, 3, generator=g) * 0.4,
        viewmats=vms,
        Ks=torch.tensor([[f, 0, W / 2], [0, f, H / 2], [0, 0, 1]]).repeat(C, 1, 1),
    )


def render(s, **kw):
    kw.setdefault("packed", False)
    return rasterization(
        s["means"], s["quats"], s["scales"], s["opacities"], s["colors"], s["viewmats"], s["Ks"], W, H, **kw
    )


@pytest.mark.parametrize("rasterize_mode", ["classic", "antialiased"])
@pytest.mark.parametrize("eps2d,near,far", [(0.3, 0.01, 1e10), (0.1, 1.5, 5.0)])
def test_projection_matches_gsplat_torch_impl(rasterize_mode, eps2d, near, far):
    s = scene()
    _, _, meta = render(s, sh_degree=3, eps2d=eps2d, near_plane=near, far_plane=far, rasterize_mode=rasterize_mode)
    covars, _ = _quat_scale_to_covar_preci(s["quats"], s["scales"], True, False, False)
    radii, means2d, depths, conics, comps = _fully_fused_projection(
        s["means"], covars, s["viewmats"], s["Ks"], W, H, eps2d, near, far, rasterize_mode == "antialiased"
    )
    assert torch.equal(meta["radii"], radii.int())
    vis = radii > 0
    assert 0 < int(vis.sum()) < vis.numel()  # both visible and culled pairs
    # Same gsplat code on each camera's visible subset: equal up to the rounding of its small einsum contractions,
    # which batch differently; a few float32 ulps at image scale (ulp(64 px) = 7.6e-6).
    for name, ours, ref, atol in [("means2d", meta["means2d"], means2d, 3e-5), ("depths", meta["depths"], depths, 1e-6),
                                  ("conics", meta["conics"], conics, 1e-6)]:
        torch.testing.assert_close(ours[vis], ref[vis], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
        assert not ours[~vis].any(), f"{name} of culled pairs must be 0"
    expected_opac = s["opacities"].repeat(2, 1) * (comps if comps is not None else 1.0)
    torch.testing.assert_close(meta["opacities"][vis], expected_opac[vis], rtol=1e-6, atol=1e-7)
    assert meta["width"] == W and meta["height"] == H and meta["n_cameras"] == 2 and meta["tile_size"] == 16
    assert meta["gaussian_ids"] is None and meta["radii"].dtype == torch.int32


def test_on_axis_gaussian_by_hand():
    """Isotropic Gaussian on the optical axis: mean at (cx, cy), cov2d = (f s / z)^2 + eps2d."""
    f, s_, z = 30.0, 0.1, 2.0
    s = dict(means=torch.tensor([[0.0, 0.0, z]]), quats=torch.tensor([[1.0, 0, 0, 0]]),
             scales=torch.full((1, 3), s_), opacities=torch.tensor([0.5]), colors=torch.rand(1, 3),
             viewmats=torch.eye(4)[None], Ks=torch.tensor([[[f, 0, W / 2], [0, f, H / 2], [0, 0, 1]]]))
    _, _, meta = render(s)
    var = (f * s_ / z) ** 2 + 0.3
    torch.testing.assert_close(meta["means2d"][0, 0], torch.tensor([W / 2, H / 2]))
    torch.testing.assert_close(meta["conics"][0, 0], torch.tensor([1 / var, 0.0, 1 / var]))
    assert int(meta["radii"][0, 0]) == math.ceil(3 * math.sqrt(var + 0.1))  # gsplat: v1 = b + sqrt(max(.01, b^2-det))


def test_fov_clamp_of_the_jacobian():
    """Far off-axis, gsplat evaluates the Jacobian at the mean clamped to 1.3x the field of view."""
    f, z = 30.0, 2.0
    x = 3.0 * z * (W / 2) / f  # 3x the half field of view: projects off-screen, but a big splat reaches in
    s = dict(means=torch.tensor([[x, 0.0, z]]), quats=torch.tensor([[1.0, 0, 0, 0]]),
             scales=torch.tensor([[4.0, 0.05, 0.05]]), opacities=torch.tensor([0.9]), colors=torch.rand(1, 3),
             viewmats=torch.eye(4)[None], Ks=torch.tensor([[[f, 0, W / 2], [0, f, H / 2], [0, 0, 1]]]))
    _, _, meta = render(s)
    assert int(meta["radii"][0, 0]) > 0
    lim = (W - W / 2) / f + 0.3 * (0.5 * W / f)
    tx = z * lim
    J = torch.tensor([[f / z, 0, -f * tx / z**2], [0, f / z, 0]], dtype=torch.float64)
    cov3 = torch.diag(torch.tensor([16.0, 0.0025, 0.0025], dtype=torch.float64))
    cov2 = J @ cov3 @ J.T + 0.3 * torch.eye(2, dtype=torch.float64)
    inv = torch.linalg.inv(cov2)
    expected = torch.stack([inv[0, 0], inv[0, 1], inv[1, 1]]).float()
    torch.testing.assert_close(meta["conics"][0, 0], expected, rtol=1e-4, atol=1e-7)


def test_sh_colors_match_gsplat():
    s = scene(n=50, C=2)
    vis = torch.ones(2, 50, dtype=torch.bool)
    vis[0, :10] = False
    for deg in range(4):
        ours = sh_colors(deg, s["colors"], s["means"], s["viewmats"], vis)
        dirs = s["means"][None] - torch.inverse(s["viewmats"])[:, None, :3, 3]
        ref = torch.clamp_min(_spherical_harmonics(deg, dirs, s["colors"].expand(2, -1, -1, -1)) + 0.5, 0.0)
        torch.testing.assert_close(ours[vis], ref[vis], rtol=1e-6, atol=1e-6)
        assert not ours[~vis].any()


@pytest.mark.parametrize("packed", [False, True])
def test_culled_gaussians_get_radius_zero_and_no_gradient(packed):
    s = scene(n=60, C=1, seed=1)
    s["means"][:, 0] *= 0.2  # keep the rest in view
    s["means"][0] = torch.tensor([0.1, 0.1, -2.0])  # behind the camera
    s["means"][1] = torch.tensor([0.2, 0.1, 0.0])  # on the camera plane (0/0 in the projection)
    s["means"][2] = torch.tensor([40.0, 0.0, 2.0])  # far outside the frustum
    s["means"][3] = torch.tensor([0.0, 0.2, 9.0])  # beyond the far plane below
    s["scales"][4] = 1e-4  # a tiny one, under radius_clip
    culled = torch.arange(5)
    p = {k: v.clone().requires_grad_() if k != "viewmats" and k != "Ks" else v for k, v in s.items()}
    rc, ra, meta = render(p, sh_degree=3, far_plane=8.0, radius_clip=1.0, packed=packed, absgrad=True,
                          render_mode="RGB+ED", backgrounds=torch.rand(1, 3))
    meta["means2d"].retain_grad()
    (rc.square().sum() + ra.sum()).backward()
    if packed:
        assert not torch.isin(meta["gaussian_ids"], culled).any()
        assert len(meta["gaussian_ids"]) >= 40
    else:
        radii = meta["radii"][0]
        assert not radii[culled].any() and (radii[5:] > 0).sum() >= 40
        assert not meta["means2d"].grad[0, culled].any() and meta["means2d"].grad[0, 5:].any()
        assert not meta["means2d"].absgrad[0, culled].any()
    for k in ("means", "quats", "scales", "opacities", "colors"):
        grad = p[k].grad
        assert torch.isfinite(grad).all(), k
        assert not grad[culled].any(), k
        assert grad[5:].any(), k
