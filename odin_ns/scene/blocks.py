"""Blocks: compact groups of Gaussians, the unit of ownership, versioning, transfer and scheduling.

`build_layout` orders the Gaussians either by a balanced k-d split of their means (`cut="kd"`, compact blocks
of near-equal size; see `scene.kd_split`) or by the Morton code of their quantized means (`cut="morton"`,
stable: equal codes keep their index order) and cuts the ordered sequence into consecutive blocks of at most
`block_size`. The result, `BlockLayout`, is plain data
(tensors and ints, no model references): it says which Gaussians form each block and how far each block extends,
and can be rebuilt identically from the same inputs. The Gaussians themselves are not reordered: the canonical
(global) order stays the model's order; `order` maps block-sorted positions to global indices.

Bounds are recomputed by `block_bounds` with `scatter_reduce` (amin/amax, exact and order independent), so the
runtime can refresh them during a phase, when means move but block membership does not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from odin_ns.scene.kd_split import kd_order, leaf_sizes
from odin_ns.scene.morton import MAX_BITS, cube_bounds, morton_order

DEFAULT_BLOCK_SIZE = 2048
SIGMAS = 3.0  # gsplat's footprint is 3 standard deviations (radius = ceil(3 * sqrt(lambda_max)))


@dataclass
class BlockLayout:
    """Which Gaussians form each block, and each block's bounds.

    Tensors are int64 (indices) or float32 (bounds, in world units), all on the CPU.
    `B` blocks, `N` Gaussians; block b holds global indices `order[offsets[b]:offsets[b+1]]`, in Morton order.
    """

    num_gaussians: int
    block_size: int
    bits: int  # Morton bits per axis
    cube_lo: Tensor  # [3] float64, lower corner of the quantization cube
    cube_edge: float  # edge of the quantization cube
    order: Tensor  # [N] global index of the Gaussian at each block-sorted position
    offsets: Tensor  # [B + 1] start of each block in `order`; offsets[-1] == N
    block_of: Tensor  # [N] block id of each Gaussian, by global index
    counts: Tensor  # [B] Gaussians per block
    lo: Tensor  # [B, 3] AABB of the means
    hi: Tensor  # [B, 3]
    ext_lo: Tensor  # [B, 3] AABB of means -/+ 3 * max scale (each Gaussian's 3-sigma sphere)
    ext_hi: Tensor  # [B, 3]
    max_scale: Tensor  # [B] largest scale (standard deviation, world units) in the block; 0 without scales

    @property
    def num_blocks(self) -> int:
        return int(self.counts.shape[0])

    def members(self, block: int) -> Tensor:
        """Global indices of block `block`'s Gaussians, in Morton order."""
        return self.order[int(self.offsets[block]) : int(self.offsets[block + 1])]

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict (for torch.save / messages); `from_dict` inverts it."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "BlockLayout":
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def build_layout(
    means: Tensor,
    scales: Optional[Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    bits: int = MAX_BITS,
    bounds: Optional[Tuple[Tensor, float]] = None,
    cut: str = "morton",
) -> BlockLayout:
    """Group Gaussians into blocks: k-d leaves of near-equal size at most `block_size` (`cut="kd"`), or runs of
    `block_size` consecutive Gaussians in Morton order, the last one smaller (`cut="morton"`).

    Args:
        means: [N, 3] positions.
        scales: [N, 3] standard deviations in world units (splatfacto stores log-scales: pass `exp(scales)`);
            None gives zero extents.
        block_size: Gaussians per block.
        bits: Morton bits per axis (1..21).
        bounds: (lo [3], edge) of the quantization cube; default: the bounding cube of `means`.
        cut: "kd" or "morton".
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if means.dim() != 2 or means.shape[1] != 3:
        raise ValueError(f"means must be [N, 3], got {tuple(means.shape)}")
    means = means.detach().cpu()
    n = int(means.shape[0])
    cube_lo, cube_edge = cube_bounds(means) if bounds is None else (bounds[0].to(torch.float64).cpu(), bounds[1])
    if cut == "kd":
        sizes = torch.as_tensor(leaf_sizes(n, block_size) if n else [], dtype=torch.int64)
        order = kd_order(means, sizes.tolist())
        num_blocks = int(sizes.numel())
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    elif cut == "morton":
        order, _ = morton_order(means, (cube_lo, cube_edge), bits)
        num_blocks = (n + block_size - 1) // block_size
        offsets = torch.clamp(torch.arange(num_blocks + 1, dtype=torch.int64) * block_size, max=n)
    else:
        raise ValueError(f"unknown block cut {cut!r} (kd or morton)")
    counts = offsets[1:] - offsets[:-1]
    block_of = torch.empty(n, dtype=torch.int64)
    block_of[order] = torch.repeat_interleave(torch.arange(num_blocks, dtype=torch.int64), counts)
    lo, hi, ext_lo, ext_hi, max_scale = block_bounds(means, scales, block_of, num_blocks)
    return BlockLayout(
        num_gaussians=n,
        block_size=block_size,
        bits=bits,
        cube_lo=cube_lo,
        cube_edge=float(cube_edge),
        order=order,
        offsets=offsets,
        block_of=block_of,
        counts=counts,
        lo=lo,
        hi=hi,
        ext_lo=ext_lo,
        ext_hi=ext_hi,
        max_scale=max_scale,
    )


def block_bounds(
    means: Tensor, scales: Optional[Tensor], block_of: Tensor, num_blocks: int
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-block (lo, hi, ext_lo, ext_hi, max_scale) of Gaussians grouped by `block_of` [N].

    lo/hi bound the means; ext_lo/ext_hi bound each Gaussian's 3-sigma sphere (mean -/+ 3 * its largest scale);
    max_scale is the largest scale in the block. Empty blocks get lo = +inf, hi = -inf, max_scale = 0.
    """
    means = means.detach().cpu().to(torch.float32)
    idx = block_of.cpu().to(torch.int64)
    if scales is None:
        smax = torch.zeros(means.shape[0], dtype=torch.float32)
    else:
        smax = scales.detach().cpu().to(torch.float32).amax(dim=1)
    reach = (SIGMAS * smax)[:, None]

    def reduce(src: Tensor, how: str, fill: float) -> Tensor:
        shape = (num_blocks,) + tuple(src.shape[1:])
        out = torch.full(shape, fill, dtype=torch.float32)
        index = idx.view(-1, *([1] * (src.dim() - 1))).expand_as(src)
        return out.scatter_reduce_(0, index, src, reduce=how, include_self=True)

    inf = float("inf")
    lo, hi = reduce(means, "amin", inf), reduce(means, "amax", -inf)
    ext_lo, ext_hi = reduce(means - reach, "amin", inf), reduce(means + reach, "amax", -inf)
    max_scale = reduce(smax, "amax", 0.0)
    return lo, hi, ext_lo, ext_hi, max_scale


def refresh_bounds(layout: BlockLayout, means: Tensor, scales: Optional[Tensor] = None) -> BlockLayout:
    """The same blocks with bounds recomputed from moved means / changed scales (membership unchanged)."""
    if means.shape[0] != layout.num_gaussians:
        raise ValueError("refresh_bounds keeps membership: the number of Gaussians must not change")
    lo, hi, ext_lo, ext_hi, max_scale = block_bounds(means, scales, layout.block_of, layout.num_blocks)
    d = layout.to_dict()
    d.update(lo=lo, hi=hi, ext_lo=ext_lo, ext_hi=ext_hi, max_scale=max_scale)
    return BlockLayout.from_dict(d)
