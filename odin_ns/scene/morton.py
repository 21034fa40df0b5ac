"""Morton (Z-order) codes of 3D points.

Blocks are runs of Morton order, so nearby Gaussians end up in the same block and a block's bounding box stays
small: that is what makes read sets (which blocks a view may see) sparse. Neither torch nor numpy has a Morton
encoder, so the bit interleaving below is written by hand (the classic "spread bits by magic masks" method).

Codes are int64: up to 21 bits per axis (63-bit codes, non-negative). Fewer bits (e.g. 10, a 30-bit code) give
the same order up to ties at coarser cells. Quantization is done in float64 in a cube (the largest extent of the
bounds on every axis), so cells are cubes and blocks come out roughly isotropic even in flat scenes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

MAX_BITS = 21  # 3 * 21 = 63 bits fit a non-negative int64

# (shift, mask) pairs that spread the low 21 bits of x so that bit i lands at bit 3*i.
_SPREAD = (
    (32, 0x1F00000000FFFF),
    (16, 0x1F0000FF0000FF),
    (8, 0x100F00F00F00F00F),
    (4, 0x10C30C30C30C30C3),
    (2, 0x1249249249249249),
)


def spread_bits(x: Tensor) -> Tensor:
    """Insert two zero bits between the low 21 bits of each int64: bit i of x goes to bit 3*i."""
    x = x.to(torch.int64) & 0x1FFFFF
    for shift, mask in _SPREAD:
        x = (x | (x << shift)) & mask
    return x


def compact_bits(x: Tensor) -> Tensor:
    """Inverse of `spread_bits`: gather bits 0, 3, 6, ... of each int64 into its low 21 bits."""
    x = x.to(torch.int64) & _SPREAD[-1][1]
    masks_before = (0x1FFFFF,) + tuple(mask for _, mask in _SPREAD[:-1])
    for (shift, _), mask in zip(reversed(_SPREAD), reversed(masks_before)):
        x = (x | (x >> shift)) & mask
    return x


def morton_encode(q: Tensor) -> Tensor:
    """Interleave integer coordinates q [N, 3] (each in [0, 2**21)) into codes [N]: x in bit 0, y in 1, z in 2."""
    if q.dim() != 2 or q.shape[1] != 3:
        raise ValueError(f"expected integer coordinates [N, 3], got {tuple(q.shape)}")
    return spread_bits(q[:, 0]) | (spread_bits(q[:, 1]) << 1) | (spread_bits(q[:, 2]) << 2)


def morton_decode(codes: Tensor) -> Tensor:
    """Inverse of `morton_encode`: codes [N] -> integer coordinates [N, 3]."""
    codes = codes.to(torch.int64)
    return torch.stack([compact_bits(codes), compact_bits(codes >> 1), compact_bits(codes >> 2)], dim=1)


def cube_bounds(points: Tensor) -> Tuple[Tensor, float]:
    """The cube used for quantization: (lower corner [3] float64, edge length > 0)."""
    p = points.detach().to(torch.float64)
    if p.shape[0] == 0:
        return torch.zeros(3, dtype=torch.float64), 1.0
    lo, hi = p.min(dim=0).values, p.max(dim=0).values
    edge = float((hi - lo).max())
    if not edge > 0.0:  # one point, or all points equal: any positive edge works
        edge = 1.0
    return lo, edge


def quantize(points: Tensor, lo: Tensor, edge: float, bits: int = MAX_BITS) -> Tensor:
    """Integer cell coordinates [N, 3] of points in the cube [lo, lo + edge]^3 cut into 2**bits cells per axis.

    Points outside the cube are clamped to the border cells (positions move during training; a layout built once
    keeps working, only less tightly)."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits per axis must be in [1, {MAX_BITS}], got {bits}")
    cells = 1 << bits
    p = points.detach().to(torch.float64)
    t = (p - lo.to(torch.float64)) * (cells / edge)
    return torch.floor(t).clamp_(0, cells - 1).to(torch.int64)


def morton_codes(
    points: Tensor, bounds: Optional[Tuple[Tensor, float]] = None, bits: int = MAX_BITS
) -> Tensor:
    """Morton codes [N] (int64) of points [N, 3]; `bounds` = (lo, edge) of the quantization cube (default: the
    points' own bounding cube)."""
    lo, edge = cube_bounds(points) if bounds is None else bounds
    return morton_encode(quantize(points, lo, edge, bits))


def morton_order(
    points: Tensor, bounds: Optional[Tuple[Tensor, float]] = None, bits: int = MAX_BITS
) -> Tuple[Tensor, Tensor]:
    """(order [N], sorted codes [N]): points[order] is in Morton order; ties keep the input order (stable sort)."""
    codes = morton_codes(points, bounds, bits)
    sorted_codes, order = torch.sort(codes, stable=True)
    return order, sorted_codes
