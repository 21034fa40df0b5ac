"""Phase-boundary rebuild: cut grown blocks, drop empty ones, renumber, rebalance ownership, move blocks.

Densification makes blocks grow (gsplat's duplicates and splits stay in their parent's block). After a refine,
a block holding more than twice `block_size` Gaussians is cut into pieces of about `block_size`: by a k-d split
of its means, or for Morton blocks by Morton order in the global cube of the table's bounds; empty blocks
disappear; new ids follow the old order.
Every rank derives the same plan from the synced table, so the reference (one rank) and N ranks get the same
blocks in the same order. Ownership is then rebalanced on the new sizes, moving as few blocks as it can, and the
moved blocks travel to their new owners with their Adam moments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np
import torch

from odin_ns.scene.morton import morton_order
from odin_ns.scene.ownership import CONTIGUOUS, Ownership, rebalance


@dataclass(frozen=True)
class RebuildPlan:
    """New block j comes from old block parent[j], as piece piece[j] of pieces[parent[j]]."""

    parent: np.ndarray  # [B'] int64
    piece: np.ndarray  # [B'] int64
    pieces: np.ndarray  # [B] int64 (0 for an emptied block)
    sizes: np.ndarray  # [B'] int64

    @property
    def changed(self) -> bool:
        return not (np.all(self.pieces == 1) and len(self.parent) == len(self.pieces))


def largest_block(block_size: int) -> int:
    """The most Gaussians a block holds between two rebuilds: one holding more is cut (`plan_rebuild`)."""
    return 2 * block_size


def piece_sizes(n: int, k: int) -> List[int]:
    """n rows cut into k near-equal consecutive pieces (larger ones first)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def plan_rebuild(counts: np.ndarray, block_size: int) -> RebuildPlan:
    counts = np.asarray(counts, dtype=np.int64)
    cut = counts > largest_block(block_size)
    pieces = np.where(counts == 0, 0, np.where(cut, -(-counts // block_size), 1))
    parent = np.repeat(np.arange(len(counts)), pieces)
    piece = np.concatenate([np.arange(k) for k in pieces]) if pieces.sum() else np.zeros(0, dtype=np.int64)
    sizes = np.concatenate([piece_sizes(int(n), int(k)) for n, k in zip(counts, pieces) if k] or [[]])
    return RebuildPlan(parent=parent.astype(np.int64), piece=piece.astype(np.int64), pieces=pieces.astype(np.int64),
                       sizes=np.asarray(sizes, dtype=np.int64))


def new_ownership(plan: RebuildPlan, old_owner: np.ndarray, num_ranks: int) -> np.ndarray:
    """New blocks start with their parent's owner (contiguous stays contiguous), then loads are rebalanced."""
    inherited = np.asarray(old_owner, dtype=np.int64)[plan.parent]
    if len(inherited) == 0:
        return inherited
    start = Ownership(inherited, num_ranks, CONTIGUOUS)
    return rebalance(start, plan.sizes.astype(np.float64)).owner


def morton_within(means: torch.Tensor, cube: Tuple[torch.Tensor, float]) -> torch.Tensor:
    """Stable Morton order of one block's rows in the global cube (the same on every rank)."""
    order, _ = morton_order(means.detach().cpu(), cube)
    return order.to(means.device)


def global_cube(lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """The bounding cube of all non-empty blocks' means, from the replicated table."""
    live = counts > 0
    low = lo[live].to(torch.float64).amin(dim=0)
    high = hi[live].to(torch.float64).amax(dim=0)
    edge = float((high - low).max().clamp_min(1e-9))
    return low, edge


def cut_rows(rows: Dict[str, torch.Tensor], order: torch.Tensor, sizes: List[int]) -> List[Dict[str, torch.Tensor]]:
    """Reorder every tensor of a block by `order` and cut it into consecutive pieces of `sizes`."""
    ordered = {k: v[order] for k, v in rows.items()}
    out, start = [], 0
    for n in sizes:
        out.append({k: v[start:start + n] for k, v in ordered.items()})
        start += n
    return out
