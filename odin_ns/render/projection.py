"""Projection of 3D Gaussians to 2D on CPU, with gsplat's numerics, written element by element.

Why by hand: gsplat's `fully_fused_projection` is a CUDA kernel, and its PyTorch reference
(`gsplat.cuda._torch_impl._fully_fused_projection`) multiplies matrices with `einsum`, which on CPU becomes GEMM
calls whose rounding depends on how many Gaussians a call holds (BLAS picks other kernels for other sizes). The
distributed runtime projects a view's Gaussians owner by owner (DESIGN.md "The data path: splats, not rows"), so a
Gaussian's splat must not depend on which others share the call: here every quantity is computed with element-wise
tensor operations (each matrix product written out as sums of products in a fixed order), so a Gaussian's splat
and its gradients are the same bits whatever the partition. The formulas are gsplat's: quaternion and scale to
covariance, world to camera, the perspective Jacobian with its 1.3x field-of-view clamp, the eps2d low-pass
dilation, the antialiasing compensation sqrt(det / det_dilated), near/far culling, radius = ceil(3 sqrt(v1)) with
v1 = b + sqrt(max(0.01, b^2 - det)) and the off-screen cull (checked against `_torch_impl` in the tests).

Added to gsplat's reference:
- `radius_clip` (the CUDA kernel culls radius <= clip);
- culled entries get exactly zero outputs and zero gradients, as with gsplat's kernels: culling is decided by a
  no-grad pass, and the differentiable pass only sees each camera's visible Gaussians (a Gaussian on a camera's
  plane would otherwise poison autograd with 0 * inf).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor


def partition_free(fn, x: Tensor) -> Tensor:
    """`fn(x)` for a unary transcendental op (exp, sigmoid) with the same bits for an element wherever it sits.

    PyTorch's CPU kernels run whole SIMD vectors with one implementation and a tensor's tail (and each thread's
    chunk tail) with the scalar one, and the two may differ in the last bit (sigmoid does here). A strided input
    takes the scalar path for every element."""
    if x.numel() == 0:
        return fn(x)
    spread = x.new_empty(tuple(x.shape) + (2,))
    spread[..., 0] = x
    return fn(spread[..., 0])


def quat_scale_to_covar(quats: Tensor, scales: Tensor) -> List[Tensor]:
    """The six entries (xx, xy, xz, yy, yz, zz) of R(q) S S R(q)^T, each [N] (gsplat's `_quat_scale_to_covar_preci`)."""
    w, x, y, z = quats.unbind(-1)
    norm = torch.sqrt(w * w + x * x + y * y + z * z).clamp_min(1e-12)  # F.normalize's eps
    w, x, y, z = w / norm, x / norm, y / norm, z / norm
    R = [[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
         [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
         [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]]
    s = scales.unbind(-1)
    M = [[R[i][j] * s[j] for j in range(3)] for i in range(3)]
    return [M[i][0] * M[k][0] + M[i][1] * M[k][1] + M[i][2] * M[k][2] for i, k in _UPPER]


_UPPER = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2))


def _sym(c: List[Tensor], i: int, k: int) -> Tensor:
    return c[_UPPER.index((min(i, k), max(i, k)))]


class RowCameras(NamedTuple):
    """The camera of each row of a projection: one for all rows (k = 1) or one per row (k = N, an owner projecting
    for several views in one call). viewmats [k, 4, 4] world-to-camera, Ks [k, 3, 3], sizes [k, 2] (width, height),
    float; positions [k, 3], where given, each camera's position (its viewmat's inverse: inverted once per view,
    not once per row)."""

    viewmats: Tensor
    Ks: Tensor
    sizes: Tensor
    positions: Optional[Tensor] = None

    @staticmethod
    def one(viewmat: Tensor, K: Tensor, width: int, height: int) -> "RowCameras":
        return RowCameras(viewmat.reshape(1, 4, 4), K.reshape(1, 3, 3),
                          torch.tensor([[float(width), float(height)]], dtype=viewmat.dtype, device=viewmat.device))

    def rows(self, ids: Tensor) -> "RowCameras":
        """The cameras of rows `ids` (the same camera when there is one for all)."""
        if self.viewmats.shape[0] == 1:
            return self
        return RowCameras(*(t.index_select(0, ids) if t is not None else None for t in self))

    def position(self, ids: Tensor) -> Tensor:
        """[n, 3] (or [1, 3] for one camera): the camera position of rows `ids`."""
        cams = self.rows(ids)
        return cams.positions if cams.positions is not None else torch.inverse(cams.viewmats.detach())[:, :3, 3]


def _project_one(means: Tensor, covar: List[Tensor], cam: RowCameras, eps2d: float, near_plane: float,
                 far_plane: float, calc_compensations: bool):
    """Element-wise: (radius float [N], means2d [N, 2], depth [N], conic [N, 3], compensation [N] or None), each
    row with its camera (`cam`: one for all rows or one per row; the same arithmetic either way)."""
    V, K, S = cam.viewmats.to(means.dtype), cam.Ks.to(means.dtype), cam.sizes.to(means.dtype)
    Rc = [[V[:, i, j] for j in range(3)] for i in range(3)]
    px, py, pz = means.unbind(-1)
    x, y, z = (Rc[i][0] * px + Rc[i][1] * py + Rc[i][2] * pz + V[:, i, 3] for i in range(3))
    # camera-space covariance Rc C Rc^T (symmetric: upper entries)
    T = [[Rc[a][0] * _sym(covar, 0, k) + Rc[a][1] * _sym(covar, 1, k) + Rc[a][2] * _sym(covar, 2, k)
          for k in range(3)] for a in range(3)]
    cc = {(a, b): T[a][0] * Rc[b][0] + T[a][1] * Rc[b][1] + T[a][2] * Rc[b][2] for a, b in _UPPER}

    def c(a, b):
        return cc[(min(a, b), max(a, b))]

    fx, fy, cx, cy = K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2]
    width, height = S[:, 0], S[:, 1]
    tan_fovx, tan_fovy = 0.5 * width / fx, 0.5 * height / fy
    lim_x_pos, lim_x_neg = (width - cx) / fx + 0.3 * tan_fovx, cx / fx + 0.3 * tan_fovx
    lim_y_pos, lim_y_neg = (height - cy) / fy + 0.3 * tan_fovy, cy / fy + 0.3 * tan_fovy
    tz2 = z * z
    tx = z * torch.clamp(x / z, min=-lim_x_neg, max=lim_x_pos)
    ty = z * torch.clamp(y / z, min=-lim_y_neg, max=lim_y_pos)
    j00, j02 = fx / z, -fx * tx / tz2
    j11, j12 = fy / z, -fy * ty / tz2
    # cov2d = J C J^T with J = [[j00, 0, j02], [0, j11, j12]]
    p0 = [j00 * c(0, k) + j02 * c(2, k) for k in range(3)]
    p1 = [j11 * c(1, k) + j12 * c(2, k) for k in range(3)]
    a = p0[0] * j00 + p0[2] * j02
    b01 = p0[1] * j11 + p0[2] * j12
    d = p1[1] * j11 + p1[2] * j12
    means2d = torch.stack([(fx * x + cx * z) / z, (fy * y + cy * z) / z], dim=-1)
    det_orig = a * d - b01 * b01
    a, d = a + eps2d, d + eps2d
    det = (a * d - b01 * b01).clamp(min=1e-10)
    comp = torch.sqrt(torch.clamp(det_orig / det, min=0.0)) if calc_compensations else None
    conic = torch.stack([d / det, -b01 / det, a / det], dim=-1)
    half = (a + d) / 2
    v1 = half + torch.sqrt(torch.clamp(half * half - det, min=0.01))
    radius = torch.ceil(3.0 * torch.sqrt(v1))
    valid = (det > 0) & (z > near_plane) & (z < far_plane)
    m2 = means2d.detach()
    inside = ((m2[:, 0] + radius > 0) & (m2[:, 0] - radius < width)
              & (m2[:, 1] + radius > 0) & (m2[:, 1] - radius < height))
    radius = torch.where(valid & inside, radius, torch.zeros_like(radius))
    return radius, means2d, z, conic, comp


def project_visible(means: Tensor, covar_of, cam: RowCameras, eps2d: float, near_plane: float, far_plane: float,
                    radius_clip: float, calc_compensations: bool):
    """(ids of the visible rows [n], radii [n] int32, means2d [n, 2], depths [n], conics [n, 3], compensations [n]
    or None). `covar_of(rows)` gives the covariance entries of those rows (all when None)."""
    cam = RowCameras(*(t.detach() if t is not None else None for t in cam))
    with torch.no_grad():
        cov = [t.detach() for t in covar_of(None)]
        radius = _project_one(means.detach(), cov, cam, eps2d, near_plane, far_plane, False)[0]
        if radius_clip > 0.0:
            radius = torch.where(radius.to(torch.float64) <= radius_clip, torch.zeros_like(radius), radius)
    ids = (radius > 0).nonzero().squeeze(1)
    _, m2, d, con, comp = _project_one(means.index_select(0, ids), covar_of(ids), cam.rows(ids), eps2d, near_plane,
                                       far_plane, calc_compensations)
    return ids, radius.index_select(0, ids).to(torch.int32), m2, d, con, comp


def covariances(quats: Optional[Tensor], scales: Optional[Tensor], covars: Optional[Tensor]):
    """`covar_of(rows)` for `project_visible`: the six covariance entries of some rows (all when None)."""
    def covar_of(rows: Optional[Tensor]) -> List[Tensor]:
        if covars is not None:
            cv = covars if rows is None else covars.index_select(0, rows)
            return [cv[:, i, k] for i, k in _UPPER]
        q = quats if rows is None else quats.index_select(0, rows)
        s = scales if rows is None else scales.index_select(0, rows)
        return quat_scale_to_covar(q, s)
    return covar_of


def project(
    means: Tensor,  # [N, 3]
    quats: Optional[Tensor],  # [N, 4] (normalized here)
    scales: Optional[Tensor],  # [N, 3]
    covars: Optional[Tensor],  # [N, 3, 3], replaces quats/scales when given
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    eps2d: float,
    near_plane: float,
    far_plane: float,
    radius_clip: float,
    calc_compensations: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Returns radii [C, N] int32 (0 = culled), means2d [C, N, 2], depths [C, N], conics [C, N, 3] and
    compensations [C, N] (or None); zeros where culled."""
    C, N = viewmats.shape[0], means.shape[0]
    covar_of = covariances(quats, scales, covars)
    radii, m2s, ds, cons, comps = [], [], [], [], []
    for c in range(C):
        cam = RowCameras.one(viewmats[c].detach().cpu(), Ks[c].detach().cpu(), width, height)
        ids, r, m2, d, con, comp = project_visible(means, covar_of, cam, eps2d, near_plane, far_plane, radius_clip,
                                                   calc_compensations)
        radii.append(torch.zeros(N, dtype=torch.int32, device=means.device).index_copy(0, ids, r))
        m2s.append(means.new_zeros(N, 2).index_copy(0, ids, m2))
        ds.append(means.new_zeros(N).index_copy(0, ids, d))
        cons.append(means.new_zeros(N, 3).index_copy(0, ids, con))
        if calc_compensations:
            comps.append(means.new_zeros(N).index_copy(0, ids, comp))
    return (
        torch.stack(radii),
        torch.stack(m2s),
        torch.stack(ds),
        torch.stack(cons),
        torch.stack(comps) if calc_compensations else None,
    )
