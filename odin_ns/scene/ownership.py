"""Ownership: which rank holds each block's master copy and optimizer state.

Two deterministic assignments, both with a stated balance bound (mean = total cost / R, cmax = largest block cost):

- `assign_contiguous`: ranks own contiguous runs of block ids. Block ids follow Morton order, so a run is a
  spatially compact region (locality for free). Cut r sits at the block boundary whose prefix cost is nearest
  to r * mean, so every rank's load is within mean +/- cmax.
- `assign_by_readers`: each block goes to the rank whose views read it most (`affinity[r, b]`, e.g. visible
  pair counts of the views the scheduler gave rank r), unless that rank would exceed the capacity
  mean * (1 + tol) + cmax; then to its next preferred rank with room. Some rank always has room (if every rank
  had load > capacity - c_b >= mean the loads would exceed the total), so loads stay <= capacity.

`rebalance(old, new_costs)` keeps owners unless the bound breaks, so it moves few blocks when costs change a little:
contiguous layouts keep each cut unless it leaves a window of +/- tol * mean / 2 around its new ideal position
(then the cut is moved just to the window's edge); reader-based layouts evict blocks only from overloaded ranks
(least-affine first) and place them like `assign_by_readers`. Both keep the bound of the matching assignment.
Costs are float64 numpy arrays: the arithmetic is exact enough to be reproducible bit for bit on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

CONTIGUOUS = "contiguous"
READERS = "readers"


@dataclass(frozen=True)
class Ownership:
    """owner[b] is the rank owning block b; `kind` says how it was built (rebalance keeps the same kind)."""

    owner: np.ndarray  # [B] int64
    num_ranks: int
    kind: str = CONTIGUOUS
    affinity: Optional[np.ndarray] = None  # [R, B] for kind == READERS

    @property
    def num_blocks(self) -> int:
        return int(self.owner.shape[0])

    def blocks_of(self, rank: int) -> np.ndarray:
        """Ascending block ids owned by `rank`."""
        return np.flatnonzero(self.owner == rank).astype(np.int64)

    @property
    def rank_blocks(self) -> List[np.ndarray]:
        return [self.blocks_of(r) for r in range(self.num_ranks)]

    def loads(self, costs: Sequence[float]) -> np.ndarray:
        """[R] summed cost per rank."""
        return np.bincount(self.owner, weights=_costs(costs), minlength=self.num_ranks)

    def moved(self, other: "Ownership") -> np.ndarray:
        """Block ids whose owner differs between self and other."""
        return np.flatnonzero(self.owner != other.owner).astype(np.int64)

    def to_dict(self) -> Dict[str, object]:
        return {"owner": self.owner.tolist(), "num_ranks": self.num_ranks, "kind": self.kind}


def _costs(costs: Sequence[float]) -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    if (c < 0).any() or not np.isfinite(c).all():
        raise ValueError("block costs must be finite and non-negative")
    return c


def _cut_costs(costs: Sequence[float]) -> np.ndarray:
    """Costs used to place contiguous cuts: all-zero costs are cut by block count instead."""
    c = _costs(costs)
    return c if c.sum() > 0 else np.ones_like(c)


def balance_bound(costs: Sequence[float], num_ranks: int, tol: float = 0.0) -> float:
    """The load no rank exceeds: mean * (1 + tol) + cmax (tol = 0 for fresh contiguous assignments)."""
    c = _costs(costs)
    if c.size == 0:
        return 0.0
    return float(c.sum() / num_ranks * (1.0 + tol) + c.max())


def _nearest_cuts(prefix: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """For each target, the index k whose prefix[k] is nearest (ties: the lower k). prefix is nondecreasing."""
    hi = np.searchsorted(prefix, targets, side="left").clip(0, prefix.size - 1)
    lo = (hi - 1).clip(0, prefix.size - 1)
    take_lo = np.abs(prefix[lo] - targets) <= np.abs(prefix[hi] - targets)
    return np.where(take_lo, lo, hi)


def _owner_from_cuts(cuts: np.ndarray, num_blocks: int) -> np.ndarray:
    # cuts[r] = first block of rank r (cuts[0] = 0), nondecreasing; rank of block b = #cuts[1:] <= b
    return np.searchsorted(cuts[1:], np.arange(num_blocks), side="right").astype(np.int64)


def assign_contiguous(costs: Sequence[float], num_ranks: int) -> Ownership:
    """Contiguous runs of blocks, each rank's load within mean +/- cmax."""
    if num_ranks < 1:
        raise ValueError("num_ranks must be positive")
    c = _cut_costs(costs)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    targets = prefix[-1] * np.arange(num_ranks) / num_ranks
    cuts = np.maximum.accumulate(_nearest_cuts(prefix, targets))
    cuts[0] = 0
    return Ownership(_owner_from_cuts(cuts, c.size), num_ranks, CONTIGUOUS)


def _cuts_of(own: Ownership) -> np.ndarray:
    o = own.owner
    if o.size and (np.diff(o) < 0).any():
        raise ValueError("ownership is not contiguous")
    return np.searchsorted(o, np.arange(own.num_ranks), side="left").astype(np.int64)


def _place(order: np.ndarray, c: np.ndarray, pref: np.ndarray, owner: np.ndarray, load: np.ndarray,
           cap: float) -> None:
    """Give each block of `order` its most preferred rank with room (pref[b] = ranks by preference)."""
    for b in order:
        for r in pref[b]:
            if load[r] + c[b] <= cap:
                break
        else:  # unreachable when cap >= mean + cmax; keep the least loaded rank to stay total
            r = int(np.argmin(load))
        owner[b] = r
        load[r] += c[b]


def _preferences(affinity: np.ndarray) -> np.ndarray:
    # [B, R] ranks by decreasing affinity, ties by rank id (stable sort of the negated values)
    return np.argsort(-affinity.T, axis=1, kind="stable")


def _check_affinity(affinity: Sequence[Sequence[float]], num_ranks: int, num_blocks: int) -> np.ndarray:
    a = np.asarray(affinity, dtype=np.float64)
    if a.shape != (num_ranks, num_blocks):
        raise ValueError(f"affinity must be [R={num_ranks}, B={num_blocks}], got {a.shape}")
    return a


def assign_by_readers(costs: Sequence[float], affinity: Sequence[Sequence[float]], num_ranks: int,
                      tol: float = 0.05) -> Ownership:
    """Blocks to the ranks that read them most, loads <= mean * (1 + tol) + cmax.

    Blocks are placed in order of decreasing best affinity (ties: lower block id), so strongly owned blocks get
    their rank before capacity runs out."""
    c = _costs(costs)
    a = _check_affinity(affinity, num_ranks, c.size)
    owner = np.zeros(c.size, dtype=np.int64)
    load = np.zeros(num_ranks, dtype=np.float64)
    order = np.lexsort((np.arange(c.size), -a.max(axis=0))) if c.size else np.zeros(0, dtype=np.int64)
    _place(order, c, _preferences(a), owner, load, balance_bound(c, num_ranks, tol))
    return Ownership(owner, num_ranks, READERS, a)


def rebalance(old: Ownership, new_costs: Sequence[float], tol: float = 0.05,
              affinity: Optional[Sequence[Sequence[float]]] = None) -> Ownership:
    """A new ownership for changed costs that moves few blocks (see the module docstring for the bound kept).

    For reader-based ownership, `affinity` replaces the stored one when given (views may have moved)."""
    c = _costs(new_costs)
    if c.size != old.num_blocks:
        raise ValueError("rebalance keeps the blocks: the number of costs must match")
    R = old.num_ranks
    if old.kind == CONTIGUOUS:
        c = _cut_costs(c)
        prefix = np.concatenate([[0.0], np.cumsum(c)])
        mean = prefix[-1] / R
        targets = mean * np.arange(R)
        ideal = _nearest_cuts(prefix, targets)
        delta = tol * mean / 2
        lo = np.minimum(ideal, np.searchsorted(prefix, targets - delta, side="left"))
        hi = np.maximum(ideal, np.searchsorted(prefix, targets + delta, side="right") - 1)
        cuts = np.maximum.accumulate(np.clip(_cuts_of(old), lo, hi))
        cuts[0] = 0
        return Ownership(_owner_from_cuts(cuts, c.size), R, CONTIGUOUS)
    a = _check_affinity(old.affinity if affinity is None else affinity, R, c.size)
    cap = balance_bound(c, R, tol)
    owner = old.owner.copy()
    load = np.bincount(owner, weights=c, minlength=R)
    evicted: List[int] = []
    for r in range(R):
        if load[r] <= cap:
            continue
        mine = np.flatnonzero(owner == r)
        for b in mine[np.lexsort((mine, a[r, mine]))]:  # least affine first, ties by block id
            if load[r] <= cap:
                break
            load[r] -= c[b]
            evicted.append(int(b))
    order = np.array(sorted(evicted, key=lambda b: (-a[:, b].max(), b)), dtype=np.int64)
    _place(order, c, _preferences(a), owner, load, cap)
    return Ownership(owner, R, READERS, a)
