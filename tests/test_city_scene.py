"""The procedural city: ray casting, determinism, locality of the views."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from odin_ns.data import city_scene as cs
from odin_ns.data.city_cache import write_dataset
from odin_ns.data.raycast import any_box_hit, nearest_box_hit

SMALL = cs.CityConfig(width=48, height=36, num_street_cameras=8, num_aerial_cameras=2, num_points=500)


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_nearest_box_hit_matches_brute_force():
    rng = np.random.default_rng(1)
    lo = rng.uniform(-5, 4, (20, 3))
    hi = lo + rng.uniform(0.2, 2.0, (20, 3))
    o = rng.uniform(-12, -8, (500, 3))
    d = rng.normal(size=(500, 3)) * 0.3 + np.array([1.0, 1.0, 1.0])
    t, box, axis = nearest_box_hit(o, d, lo, hi)
    # Brute force: march each ray finely and find the first sample inside a box.
    ts = np.linspace(0, 30, 6001)
    for r in range(0, 500, 25):
        p = o[r] + ts[:, None] * d[r]
        inside = np.any(np.all((p[:, None] >= lo) & (p[:, None] <= hi), axis=2), axis=1)
        if not inside.any():
            assert box[r] == -1 and np.isinf(t[r])
            continue
        assert box[r] >= 0
        assert abs(ts[inside.argmax()] - t[r]) <= 30 / 6000 + 1e-9
        q = o[r] + t[r] * d[r]
        # The hit lies on the entered face of the reported box.
        assert np.all(q >= lo[box[r]] - 1e-9) and np.all(q <= hi[box[r]] + 1e-9)
        assert abs(q[axis[r]] - (lo[box[r], axis[r]] if d[r, axis[r]] > 0 else hi[box[r], axis[r]])) < 1e-9
    # Occlusion queries agree with nearest hits.
    blocked = any_box_hit(o, d, lo, hi, t_max=t + 1e-6)
    assert np.array_equal(blocked, np.isfinite(t))
    assert not any_box_hit(o, d, lo, hi, t_max=t - 1e-6)[np.isfinite(t)].any()


def test_tile_culling_is_exact():
    """Tracing with per-tile culled boxes gives the same hits as tracing against every box."""
    city = cs.build_city(SMALL)
    cams = cs.make_cameras(SMALL, city)
    jj, ii = np.meshgrid(np.arange(SMALL.width) + 0.5, np.arange(SMALL.height) + 0.5)
    u, v = jj.ravel(), ii.ravel()
    for i in range(len(cams)):
        hit, _ = cs.trace_view(city, cams, i, u, v, shadows=False)
        o, d = cs.pixel_rays(cams.c2w[i], cams.fx[i], cams.fy[i], cams.cx[i], cams.cy[i], u, v)
        full = cs.trace(city, o, d)
        assert np.array_equal(hit["box"], full["box"])
        assert np.array_equal(hit["t"], full["t"])


def test_generation_is_deterministic(tmp_path):
    a = cs.render_city(SMALL, num_threads=2)
    b = cs.render_city(SMALL, num_threads=1)
    assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images))
    assert np.array_equal(a.points_xyz, b.points_xyz) and np.array_equal(a.points_rgb, b.points_rgb)
    write_dataset(a, tmp_path / "a")
    write_dataset(b, tmp_path / "b")
    da, db = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert len(da) == SMALL.num_cameras + 3
    assert da == db
    # The seed matters.
    c = cs.render_city(cs.CityConfig(**{**SMALL.to_dict(), "seed": 1}), num_threads=1)
    assert not np.array_equal(a.images[0], c.images[0])
    assert SMALL.key() != c.config.key()


def test_images_look_like_a_city():
    r = cs.render_city(SMALL, num_threads=1)
    for img, kind in zip(r.images, r.cameras.kind):
        assert img.shape == (SMALL.height, SMALL.width, 4) and img.dtype == np.uint8
        alpha = img[..., 3]
        assert (alpha == 255).mean() > 0.3  # mostly geometry
        assert img[..., :3][alpha == 255].std() > 10  # textured, not flat
        if kind == "aerial":
            assert (alpha == 255).mean() > 0.95  # aerial obliques look down at the ground
    assert len(r.points_xyz) == SMALL.num_points
    assert r.points_visibility.sum(axis=0).min() >= 2  # SfM-like: each point seen twice or more


def test_each_view_sees_a_part_and_together_they_cover_the_city():
    cfg = cs.CityConfig()
    city = cs.build_city(cfg)
    cams = cs.make_cameras(cfg, city)
    samples = cs.surface_samples(city, 8000)
    vis = cs.visibility(city, cams, samples)
    frac = vis.mean(axis=1)
    kinds = np.array(cams.kind)
    assert frac.max() < 0.3, frac.max()
    assert np.median(frac[kinds == "street"]) < 0.12
    assert vis.any(axis=0).mean() > 0.8  # the union covers the city
    # Locality: many pairs of views share no surface at all.
    inter = (vis[:, None] & vis[None]).sum(-1)
    iu = np.triu_indices(len(vis), 1)
    assert (inter[iu] == 0).mean() > 0.3


def test_street_cameras_keep_clear_of_geometry():
    cfg = cs.CityConfig()
    city = cs.build_city(cfg)
    cams = cs.make_cameras(cfg, city)
    jj, ii = np.meshgrid(np.arange(cfg.width) + 0.5, np.arange(cfg.height) + 0.5)
    scale = cs.unit_scale(city)
    for i in range(len(cams)):
        hit, _ = cs.trace_view(city, cams, i, jj.ravel(), ii.ravel(), shadows=False)
        o, d = cs.pixel_rays(cams.c2w[i], cams.fx[i], cams.fy[i], cams.cx[i], cams.cy[i], jj.ravel(), ii.ravel())
        dist = hit["t"][hit["hit"]] * np.linalg.norm(d[hit["hit"]], axis=1)
        # Nearest visible surface well beyond the rasterizer's near plane (0.01 in parser units).
        assert dist.min() * scale > 0.02, (i, dist.min())
        # Geometry in view (no view of only sky).
        assert hit["hit"].mean() > 0.3


@pytest.mark.parametrize("bad", [dict(blocks_x=0), dict(width=4), dict(num_street_cameras=1, num_aerial_cameras=0)])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        cs.CityConfig(**bad)
