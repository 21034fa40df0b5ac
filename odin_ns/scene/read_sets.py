"""Conservative read sets: the blocks a camera may see during a phase.

A view must never render without a Gaussian that the synchronous reference would render (DESIGN.md, semantics 6),
so the read set must contain every block holding a Gaussian that gsplat's projection keeps (radii > 0), for any
position and scale the optimizer can reach within the phase. The test here is derived from gsplat's own
projection (`gsplat/cuda/_torch_impl.py::_fully_fused_projection`, pinhole; the CUDA kernel is the same formula),
not from a generic frustum, because a plain "AABB inflated by 3 sigma vs frustum" test is *not* conservative
against it: gsplat dilates the 2D covariance by `eps2d`, rounds the radius up, uses a square footprint of the
largest axis and linearizes the projection with a Jacobian that grows away from the image center.

gsplat keeps Gaussian i in a camera iff (OpenCV camera coordinates t = R mean + T, pixel x = K[0].t / t_z):
    near < t_z < far,  and  x + r_x > 0,  x - r_x < W,  y + r_y > 0,  y - r_y < H,
with, for S2 = J Sigma J^T + eps2d I:
    gsplat 1.4 (pinned by nerfstudio 1.1.5): r_x = r_y = ceil(3 sqrt(v1)), v1 = b + sqrt(max(b^2 - det, 0.01)),
        b and det of S2, so v1 <= lambda_max(S2) + 0.1;
    gsplat >= 1.5: r_x = ceil(k sqrt(S2_xx)), r_y = ceil(k sqrt(S2_yy)), k = min(3.33, opacity-aware) <= 3.33.
Both are <= ceil(k sqrt(lambda_max(J Sigma J^T) + eps2d + 0.1)) with k = `sigmas` (default 3.33 covers both).
With lambda_max(J Sigma J^T) <= s^2 lambda_max(J J^T) (s the largest scale) and J J^T t_z^2 = F (I + w w^T) F,
F = diag(fx, fy), w the normalized coordinates that gsplat clamps to |w_x| <= Lx, |w_y| <= Ly:
    r * t_z <= k s G + P t_z,   G = max(fx, fy) sqrt(1 + Lx^2 + Ly^2),   P = k sqrt(eps2d + 0.1) + 1.
Multiplying the four image conditions by t_z > 0 turns each into a linear function of the world position that
must exceed -k s G, e.g. the left edge: K[0].t + P t_z > -k s G. Each is a plane; a block passes a plane iff the
plane's maximum over the block's AABB (of means, inflated by the motion bound) clears the slack. This is the
standard exact AABB-vs-plane test, vectorized over cameras x planes x blocks. A block rejected by one plane has
no point, hence no Gaussian, that gsplat could keep: the read set never misses.

What this does not cover (callers must): cameras other than pinhole, gsplat's `radius_clip` (only shrinks the
set), and bounds that are too small (motion and scale growth are inputs; `adam_step_bound` gives a rigorous one).
"""

from __future__ import annotations

import math
from typing import Iterable, Tuple, Union

import torch
from torch import Tensor

EPS2D = 0.3  # gsplat's default 2D dilation (rasterization(eps2d=0.3))
SIGMAS = 3.33  # footprint in standard deviations: 3 in gsplat 1.4, at most 3.33 in gsplat >= 1.5
REL_TOL = 1e-5  # slack for gsplat's float32 rounding near a plane (relative to the plane's magnitude)


def _as_batch(viewmats: Tensor, Ks: Tensor) -> Tuple[Tensor, Tensor]:
    viewmats = viewmats.detach().cpu().to(torch.float64)
    Ks = Ks.detach().cpu().to(torch.float64)
    if viewmats.dim() == 2:
        viewmats = viewmats[None]
    if Ks.dim() == 2:
        Ks = Ks[None]
    if viewmats.shape[1:] != (4, 4) or Ks.shape[1:] != (3, 3) or viewmats.shape[0] != Ks.shape[0]:
        raise ValueError(
            f"expected viewmats [C, 4, 4] and Ks [C, 3, 3], got {tuple(viewmats.shape)}, {tuple(Ks.shape)}"
        )
    return viewmats, Ks


def view_planes(
    viewmats: Tensor,
    Ks: Tensor,
    width: int,
    height: int,
    near: float = 0.01,
    far: float = 1e10,
    eps2d: float = EPS2D,
    sigmas: float = SIGMAS,
) -> Tuple[Tensor, Tensor, Tensor]:
    """The six planes of gsplat's visibility test, in world coordinates.

    Returns (normals [C, 6, 3], offsets [C, 6], slack [C, 6]), float64: a point p with largest scale s can be kept
    by camera c only if `normals[c, k] . p + offsets[c, k] > -slack[c, k] * s` for every plane k (order: near, far,
    left, right, top, bottom). Near/far test the mean only (as gsplat does), so their slack is 0.
    """
    if near <= 0:
        raise ValueError("near must be positive (the derivation multiplies by the depth)")
    viewmats, Ks = _as_batch(viewmats, Ks)
    R, T = viewmats[:, :3, :3], viewmats[:, :3, 3]
    fx, fy, cx, cy = Ks[:, 0, 0], Ks[:, 1, 1], Ks[:, 0, 2], Ks[:, 1, 2]
    # gsplat's clamp limits of the normalized coordinates used in the Jacobian (_persp_proj)
    tan_x, tan_y = 0.5 * width / fx, 0.5 * height / fy
    lim_x = torch.maximum((width - cx) / fx, cx / fx) + 0.3 * tan_x
    lim_y = torch.maximum((height - cy) / fy, cy / fy) + 0.3 * tan_y
    gain = torch.maximum(fx, fy) * torch.sqrt(1.0 + lim_x**2 + lim_y**2)  # G
    pad = sigmas * math.sqrt(eps2d + 0.1) + 1.0  # P, in pixels

    z = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand_as(Ks[:, 0])
    k0, k1 = Ks[:, 0], Ks[:, 1]
    # camera-space linear forms a . t + b (t = R p + T): must be > -slack * s
    a = torch.stack([z, -z, k0 + pad * z, width * z - k0 + pad * z, k1 + pad * z, height * z - k1 + pad * z], dim=1)
    b = torch.zeros(a.shape[:2], dtype=torch.float64)
    b[:, 0], b[:, 1] = -near, far
    slack = torch.zeros_like(b)
    slack[:, 2:] = sigmas * gain[:, None]
    normals = torch.einsum("cki,cij->ckj", a, R)  # a . (R p) = (R^T a) . p
    offsets = torch.einsum("cki,ci->ck", a, T) + b
    return normals, offsets, slack


def blocks_in_view(
    lo: Tensor,
    hi: Tensor,
    viewmats: Tensor,
    Ks: Tensor,
    width: int,
    height: int,
    near: float = 0.01,
    far: float = 1e10,
    max_scale: Union[Tensor, float, None] = None,
    motion: Union[Tensor, float] = 0.0,
    log_scale_growth: float = 0.0,
    eps2d: float = EPS2D,
    sigmas: float = SIGMAS,
) -> Tensor:
    """Bool [C, B]: may camera c keep (radii > 0) any Gaussian of block b during the phase?

    Args:
        lo, hi: [B, 3] AABB of the block's means at the start of the phase (`BlockLayout.lo/hi`).
        viewmats: [C, 4, 4] or [4, 4] world-to-camera, OpenCV convention (gsplat's `viewmats`).
        Ks: [C, 3, 3] or [3, 3] pinhole intrinsics in pixels.
        width, height: image size in pixels; near, far: gsplat's near_plane / far_plane.
        max_scale: [B] or scalar, largest scale (std dev, world units) in the block (`BlockLayout.max_scale`);
            None = 0 (points).
        motion: [B] or scalar, bound on how far (Euclidean) any mean of the block may move within the phase.
        log_scale_growth: bound on how much any log-scale may grow within the phase.
        eps2d: gsplat's 2D dilation; sigmas: gsplat's footprint in standard deviations (see module docstring).
    """
    normals, offsets, slack = view_planes(viewmats, Ks, width, height, near, far, eps2d, sigmas)
    lo = lo.detach().cpu().to(torch.float64)
    hi = hi.detach().cpu().to(torch.float64)
    nb = lo.shape[0]
    motion_t = torch.as_tensor(motion, dtype=torch.float64).expand(nb)
    center = (lo + hi) / 2
    half = (hi - lo) / 2 + motion_t[:, None]  # empty blocks (lo=+inf, hi=-inf) give nan: rejected below
    scale = torch.zeros(nb, dtype=torch.float64) if max_scale is None else torch.as_tensor(max_scale).detach().cpu()
    scale = scale.to(torch.float64).expand(nb) * math.exp(log_scale_growth)
    # max over the box of n . p + d = n . center + |n| . half + d
    reach = torch.einsum("ckj,bj->ckb", normals, center) + torch.einsum("ckj,bj->ckb", normals.abs(), half)
    best = reach + offsets[..., None]
    tol = REL_TOL * (
        torch.einsum("ckj,bj->ckb", normals.abs(), center.abs() + half) + offsets.abs()[..., None] + 1.0
    )
    keep = best + slack[..., None] * scale[None, None, :] + tol > 0
    return keep.all(dim=1) & (half >= 0).all(dim=1)[None, :]


def blocks_in_views(lo: Tensor, hi: Tensor, viewmats: Tensor, Ks: Tensor, widths: Tensor, heights: Tensor,
                    max_scale: Tensor, motion: Tensor, log_scale_growth: Tensor, near: float = 0.01,
                    far: float = 1e10) -> Tensor:
    """Bool [C, B]: `blocks_in_view` for many cameras in one call, each with its own image size, motion bound and
    log-scale growth bound (the views of a whole phase, each inflated by the motion possible up to its step).
    Cameras of one image size share one set of planes; the test is the same per camera."""
    out = torch.zeros((viewmats.shape[0], lo.shape[0]), dtype=torch.bool)
    sizes = torch.stack([torch.as_tensor(widths), torch.as_tensor(heights)], dim=1).tolist()
    groups: dict = {}
    for c, (w, h) in enumerate(sizes):
        groups.setdefault((int(w), int(h)), []).append(c)
    lo64, hi64 = lo.detach().cpu().to(torch.float64), hi.detach().cpu().to(torch.float64)
    center = (lo64 + hi64) / 2
    half = (hi64 - lo64) / 2
    scale = torch.as_tensor(max_scale).detach().cpu().to(torch.float64).expand(lo.shape[0])
    for (w, h), cams in groups.items():
        at = torch.tensor(cams, dtype=torch.int64)
        normals, offsets, slack = view_planes(viewmats[at], Ks[at], w, h, near, far)
        m = torch.as_tensor(motion, dtype=torch.float64)[at]
        g = torch.exp(torch.as_tensor(log_scale_growth, dtype=torch.float64)[at])
        absn = normals.abs()
        reach = (torch.einsum("ckj,bj->ckb", normals, center) + torch.einsum("ckj,bj->ckb", absn, half)
                 + (absn.sum(dim=2) * m[:, None])[..., None])
        best = reach + offsets[..., None]
        tol = REL_TOL * (torch.einsum("ckj,bj->ckb", absn, center.abs() + half)
                         + (absn.sum(dim=2) * m[:, None])[..., None] + offsets.abs()[..., None] + 1.0)
        keep = best + slack[..., None] * (scale[None, None, :] * g[:, None, None]) + tol > 0
        out[at] = keep.all(dim=1) & (half >= 0).all(dim=1)[None, :]
    return out


def read_set(
    lo: Tensor,
    hi: Tensor,
    viewmat: Tensor,
    K: Tensor,
    width: int,
    height: int,
    near: float = 0.01,
    far: float = 1e10,
    max_scale: Union[Tensor, float, None] = None,
    motion: Union[Tensor, float] = 0.0,
    log_scale_growth: float = 0.0,
    eps2d: float = EPS2D,
    sigmas: float = SIGMAS,
) -> Tensor:
    """Ascending block ids [k] (int64) that one camera may see; see `blocks_in_view`."""
    mask = blocks_in_view(
        lo, hi, viewmat, K, width, height, near, far, max_scale, motion, log_scale_growth, eps2d, sigmas
    )
    return torch.nonzero(mask[0]).flatten()


def adam_step_bound(lr: float, betas: Tuple[float, float] = (0.9, 0.999), step: int = 0,
                    bias_correction: bool = True) -> float:
    """Rigorous bound on |change| of one element in one selective-Adam update at group step `step` (1-based).

    For any gradient history (moments zeroed at any time, e.g. by densification), with q = beta1 / sqrt(beta2) < 1:
        |m_t| <= (1 - beta1) sum_k beta1^k |g_{t-k}|  and  sqrt(v_t) >= sqrt(1 - beta2) beta2^(k/2) |g_{t-k}|,
    so |m_t| / sqrt(v_t) <= (1 - beta1) / sqrt(1 - beta2) * sum_{k<t} q^k; bias correction multiplies the update by
    sqrt(1 - beta2^t) / (1 - beta1^t); eps only shrinks it. At t = 1 this is exactly lr. `step=0` gives the
    supremum over all t. Much larger than typical updates (~lr): it bounds adversarial gradient sequences.
    """
    b1, b2 = betas
    q = b1 / math.sqrt(b2)
    if q >= 1:
        raise ValueError("the bound needs beta1 < sqrt(beta2)")
    base = (1 - b1) / math.sqrt(1 - b2)
    if step <= 0:
        return lr * base / (1 - q)  # sup over t (the bias factor tends to 1 from below)
    series = (1 - q**step) / (1 - q)
    bias = math.sqrt(1 - b2**step) / (1 - b1**step) if bias_correction else 1.0
    return lr * base * series * bias


def motion_bound(lrs: Iterable[float], first_step: int, betas: Tuple[float, float] = (0.9, 0.999),
                 bias_correction: bool = True) -> float:
    """Euclidean bound on how far a 3-vector parameter (a mean) can move over the steps first_step, first_step+1,
    ... with learning rates `lrs` (one per step): sqrt(3) * sum_t adam_step_bound(lr_t, t)."""
    total = sum(adam_step_bound(lr, betas, first_step + i, bias_correction) for i, lr in enumerate(lrs))
    return math.sqrt(3.0) * total


def adam_ratio_cap(betas: Tuple[float, float] = (0.9, 0.999)) -> float:
    """Bound on |m_t| / sqrt(v_t) for every element, every step, any gradient history (moments start at zero or
    are zeroed at any time): a tighter rigorous bound than the geometric sum of `adam_step_bound`.

    With r_t = m_t^2 / v_t, Cauchy-Schwarz on m' = b1 m + (1 - b1) g and v' = b2 v + (1 - b2) g^2 gives
        r' <= (b1^2 / b2) r + (1 - b1)^2 / (1 - b2),
    so from r_0 = 0, r_t <= ((1 - b1)^2 / (1 - b2)) / (1 - b1^2 / b2) for all t (about 52.9 for Adam's defaults:
    |m| / sqrt(v) <= 7.27, against 31.8 for the sum bound). Written here because no library states it."""
    b1, b2 = betas
    c = b1 * b1 / b2
    if c >= 1:
        raise ValueError("the bound needs beta1^2 < beta2")
    return math.sqrt(((1 - b1) ** 2 / (1 - b2)) / (1 - c))


def tight_step_bound(lr: float, betas: Tuple[float, float] = (0.9, 0.999), step: int = 0,
                     bias_correction: bool = True) -> float:
    """Rigorous bound on |change| of one element in one selective-Adam update at group step `step` (1-based;
    0 = any step): lr * `adam_ratio_cap` * sqrt(1 - b2^t) / (1 - b1^t) (the bias factor is at most 1)."""
    b1, b2 = betas
    bias = 1.0
    if bias_correction and step > 0:
        bias = min(1.0, math.sqrt(1 - b2**step) / (1 - b1**step))
    return lr * adam_ratio_cap(betas) * bias
