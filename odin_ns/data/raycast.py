"""Exact, vectorized ray casting against axis-aligned boxes and a bounded ground plane (numpy only).

All functions are pure and deterministic: float64 arithmetic, fixed chunking, ties broken by the lowest box index.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

# Pairs (ray, box) evaluated at once; bounds the temporaries to a few tens of MiB.
_PAIRS_PER_CHUNK = 1 << 19
_TINY = 1e-12


def safe_inverse(d: np.ndarray) -> np.ndarray:
    """1/d with exact zeros nudged to a tiny value of the same sign convention (no inf*0 = nan in the slabs)."""
    d = np.where(np.abs(d) < _TINY, np.where(d < 0, -_TINY, _TINY), d)
    return 1.0 / d


def _slabs(o: np.ndarray, inv: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Entry and exit t of rays (r) against boxes (B): two (r, B) arrays (entry > exit: miss)."""
    tn = tf = None
    for k in range(3):
        a = (lo[None, :, k] - o[:, k, None]) * inv[:, k, None]
        b = (hi[None, :, k] - o[:, k, None]) * inv[:, k, None]
        near, far = np.minimum(a, b), np.maximum(a, b)
        if tn is None:
            tn, tf = near, far
        else:
            np.maximum(tn, near, out=tn)
            np.minimum(tf, far, out=tf)
    return tn, tf


def _entry_axis(o: np.ndarray, inv: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Axis of the face through which each ray enters its own box (rows aligned)."""
    a = (lo - o) * inv
    b = (hi - o) * inv
    return np.minimum(a, b).argmax(axis=1).astype(np.int8)


def nearest_box_hit(
    o: np.ndarray, d: np.ndarray, lo: np.ndarray, hi: np.ndarray, eps: float = 1e-6
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First intersection of rays with boxes.

    Args:
        o, d: ray origins and directions, (R, 3) float64 (d need not be normalized; t is in units of |d|).
        lo, hi: box corners, (B, 3) float64.
        eps: hits at t <= eps are ignored (ray origins on a surface).

    Returns:
        t (R,) float64, inf where nothing is hit; box (R,) int64, -1 where nothing is hit; axis (R,) int8, the axis
        of the face that was entered (the face normal is -sign(d[axis]) along that axis).
    """
    r = o.shape[0]
    t_best = np.full(r, np.inf)
    box = np.full(r, -1, dtype=np.int64)
    axis = np.zeros(r, dtype=np.int8)
    if lo.shape[0] == 0 or r == 0:
        return t_best, box, axis
    inv = safe_inverse(d)
    step = max(1, _PAIRS_PER_CHUNK // lo.shape[0])
    for s in range(0, r, step):
        e = min(r, s + step)
        tn, tf = _slabs(o[s:e], inv[s:e], lo, hi)
        tn[(tn > tf) | (tn <= eps)] = np.inf
        j = tn.argmin(axis=1)
        tb = tn[np.arange(e - s), j]
        hit = np.isfinite(tb)
        t_best[s:e] = tb
        box[s:e] = np.where(hit, j, -1)
        axis[s:e] = _entry_axis(o[s:e], inv[s:e], lo[j], hi[j])
    return t_best, box, axis


def any_box_hit(
    o: np.ndarray, d: np.ndarray, lo: np.ndarray, hi: np.ndarray, t_max: float | np.ndarray = np.inf,
    eps: float = 1e-6,
) -> np.ndarray:
    """True for rays that enter (or leave) some box at a t in (eps, t_max): occlusion / shadow queries.

    A ray whose origin lies inside a box counts as blocked (it leaves the box at tf > eps).
    """
    r = o.shape[0]
    out = np.zeros(r, dtype=bool)
    if lo.shape[0] == 0 or r == 0:
        return out
    inv = safe_inverse(d)
    t_max = np.broadcast_to(np.asarray(t_max, dtype=np.float64), (r,))
    step = max(1, _PAIRS_PER_CHUNK // lo.shape[0])
    for s in range(0, r, step):
        e = min(r, s + step)
        tn, tf = _slabs(o[s:e], inv[s:e], lo, hi)
        blocked = (tn <= tf) & (tf > eps) & (tn < t_max[s:e, None])
        out[s:e] = blocked.any(axis=1)
    return out


def ground_hit(o: np.ndarray, d: np.ndarray, extent: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """t of the hit with the ground plane z=0 inside extent = [xmin, xmax, ymin, ymax] (seen from above); inf else."""
    dz = d[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(dz < -_TINY, -o[:, 2] / np.where(dz < -_TINY, dz, -1.0), np.inf)
    x = o[:, 0] + t * d[:, 0]
    y = o[:, 1] + t * d[:, 1]
    inside = (t > eps) & np.isfinite(t) & (x >= extent[0]) & (x <= extent[1]) & (y >= extent[2]) & (y <= extent[3])
    return np.where(inside, t, np.inf)


def box_corners(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """(B, 8, 3) corners of boxes."""
    return np.stack([
        np.stack([np.where(c & 1, hi[:, 0], lo[:, 0]),
                  np.where(c & 2, hi[:, 1], lo[:, 1]),
                  np.where(c & 4, hi[:, 2], lo[:, 2])], axis=-1)
        for c in range(8)
    ], axis=1)


def frustum_cull(corners: np.ndarray, w2c: np.ndarray, x_lo: float, x_hi: float, y_lo: float, y_hi: float,
                 near: float = 1e-3, far: float = np.inf) -> np.ndarray:
    """Indices of boxes (given by their (B, 8, 3) corners) that may intersect a (possibly off-centre) frustum of an
    OpenGL camera (looks down -Z).

    The frustum holds camera-space points with depth = -z in [near, far], x/depth in [x_lo, x_hi] and y/depth in
    [y_lo, y_hi]. Conservative: a box is dropped only when all 8 corners lie outside one of the six planes.
    """
    if corners.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    pc = corners @ w2c[:3, :3].T + w2c[:3, 3]
    depth = -pc[..., 2]
    x, y = pc[..., 0], pc[..., 1]
    out = (
        np.all(depth < near, axis=1)
        | np.all(depth > far, axis=1)
        | np.all(x > x_hi * depth, axis=1)
        | np.all(x < x_lo * depth, axis=1)
        | np.all(y > y_hi * depth, axis=1)
        | np.all(y < y_lo * depth, axis=1)
    )
    return np.nonzero(~out)[0]


def rays_cull(corners: np.ndarray, c2w: np.ndarray, d: np.ndarray, far: float = np.inf,
              margin: float = 1e-3) -> np.ndarray:
    """Boxes that rays leaving the camera centre of c2w along world directions d (in front of it) may hit."""
    if len(d) == 0:
        return np.zeros(0, dtype=np.int64)
    dc = d @ c2w[:3, :3]  # world -> camera rotation is R^T
    depth = -dc[:, 2]
    if np.any(depth <= 0):
        raise ValueError("rays_cull needs rays in front of the camera")
    tx, ty = dc[:, 0] / depth, dc[:, 1] / depth
    w2c = rigid_inverse(c2w)
    return frustum_cull(corners, w2c, tx.min() - margin, tx.max() + margin, ty.min() - margin, ty.max() + margin,
                        far=far)


def rigid_inverse(c2w: np.ndarray) -> np.ndarray:
    """Inverse of a 4x4 (or 3x4) rigid transform."""
    R, t = c2w[:3, :3], c2w[:3, 3]
    out = np.eye(4)
    out[:3, :3] = R.T
    out[:3, 3] = -R.T @ t
    return out


def direction_basis(direction: np.ndarray) -> np.ndarray:
    """(3, 3) orthonormal basis whose last column is the unit direction."""
    L = np.asarray(direction, dtype=np.float64)
    L = L / np.linalg.norm(L)
    helper = np.array([0.0, 0.0, 1.0]) if abs(L[2]) < 0.9 else np.array([1.0, 0.0, 0.0])
    e1 = np.cross(L, helper)
    e1 /= np.linalg.norm(e1)
    return np.stack([e1, np.cross(L, e1), L], axis=1)


def parallel_cull(corners_in_basis: np.ndarray, points: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """Boxes that rays from `points` along one common direction (e.g. towards the sun) may hit.

    corners_in_basis: box corners expressed in `direction_basis(direction)` (corners @ basis), (B, 8, 3). Keeps the
    boxes whose projection along the direction overlaps the points' and that reach beyond the points along it.
    """
    if corners_in_basis.shape[0] == 0 or len(points) == 0:
        return np.zeros(0, dtype=np.int64)
    pb = points @ basis
    cb = corners_in_basis
    pmin, pmax = pb.min(axis=0) - 1e-6, pb.max(axis=0) + 1e-6
    keep = (
        (cb[..., 0].max(axis=1) >= pmin[0]) & (cb[..., 0].min(axis=1) <= pmax[0])
        & (cb[..., 1].max(axis=1) >= pmin[1]) & (cb[..., 1].min(axis=1) <= pmax[1])
        & (cb[..., 2].max(axis=1) >= pmin[2])
    )
    return np.nonzero(keep)[0]
