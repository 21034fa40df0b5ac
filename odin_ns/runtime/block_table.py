"""The block table: what every rank knows about every block (owner, size, bounds, version).

It is small (a few numbers per block) and replicated: each rank holds the same table, updated from the same
messages, so every rank can derive the whole communication plan of a step (who reads what, who sends what to
whom) without asking. Only owners change a block's row; `sync` spreads the owners' rows to everyone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from odin_ns.runtime.transport import all_gather_rows
from odin_ns.scene.blocks import block_bounds, build_layout
from odin_ns.scene.ownership import assign_contiguous
from odin_ns.runtime.waits import WaitLog

_SYNC_WIDTH = 9  # version, count, lo xyz, hi xyz, max_scale


@dataclass
class BlockTable:
    """Per block b: owner[b], count[b] Gaussians, the AABB lo/hi of its means, its largest scale, its version."""

    owner: torch.Tensor  # [B] int64
    count: torch.Tensor  # [B] int64
    lo: torch.Tensor  # [B, 3] float32
    hi: torch.Tensor  # [B, 3] float32
    max_scale: torch.Tensor  # [B] float32 (standard deviation, world units)
    version: torch.Tensor  # [B] int64

    @property
    def num_blocks(self) -> int:
        return int(self.owner.shape[0])

    def owned(self, rank: int) -> torch.Tensor:
        """Ascending ids of the blocks `rank` owns."""
        return torch.nonzero(self.owner == rank).flatten()

    def owned_ranges(self, rank: int) -> Dict[int, Tuple[int, int]]:
        """Block id -> (start, stop) rows in the rank's owned tensors (owned blocks concatenated in id order)."""
        ranges, start = {}, 0
        for b in self.owned(rank).tolist():
            n = int(self.count[b])
            ranges[b] = (start, start + n)
            start += n
        return ranges

    def first_places(self) -> torch.Tensor:
        """[B] each block's first row in the whole model (its blocks in id order)."""
        return torch.cumsum(self.count, 0) - self.count

    def num_owned_gaussians(self, rank: int) -> int:
        return int(self.count[self.owner == rank].sum())

    def update_owned(self, rank: int, count: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     max_scale: torch.Tensor, bumped: torch.Tensor) -> None:
        """Write this rank's rows: new sizes and bounds; versions of `bumped` (bool, per owned block) + 1."""
        ids = self.owned(rank)
        self.count[ids] = count.to(torch.int64)
        self.lo[ids], self.hi[ids], self.max_scale[ids] = lo, hi, max_scale
        self.version[ids] += bumped.to(torch.int64)

    def sync(self, rank: int, world_size: int, log: WaitLog, cause: str) -> None:
        """Every rank sends its owned rows and takes everyone else's (an all-gather: a global barrier)."""
        per_rank = [int((self.owner == r).sum()) for r in range(world_size)]
        ids = self.owned(rank)
        rows = torch.cat([
            self.version[ids, None].double(), self.count[ids, None].double(), self.lo[ids].double(),
            self.hi[ids].double(), self.max_scale[ids, None].double(),
        ], dim=1) if len(ids) else torch.zeros((0, _SYNC_WIDTH), dtype=torch.float64)
        gathered: List[torch.Tensor] = all_gather_rows(rows, per_rank, log, cause)
        for r, got in enumerate(gathered):
            if r == rank or got.shape[0] == 0:
                continue
            theirs = self.owned(r)
            self.version[theirs] = got[:, 0].round().to(torch.int64)
            self.count[theirs] = got[:, 1].round().to(torch.int64)
            self.lo[theirs] = got[:, 2:5].float()
            self.hi[theirs] = got[:, 5:8].float()
            self.max_scale[theirs] = got[:, 8].float()


def shard_bounds(params: Dict[str, torch.Tensor], ranges: Dict[int, Tuple[int, int]]):
    """(lo, hi, max_scale) of each owned block, in id order, from the owned tensors (means and log-scales)."""
    ids = sorted(ranges)
    n = params["means"].shape[0]
    block_of = torch.empty(n, dtype=torch.int64, device=params["means"].device)
    for i, b in enumerate(ids):
        block_of[ranges[b][0]:ranges[b][1]] = i
    lo, hi, _, _, max_scale = block_bounds(params["means"], torch.exp(params["scales"]).detach(), block_of, len(ids))
    return lo, hi, max_scale


def expand_ranges(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """cat(arange(s, s + c) for s, c in zip(starts, counts)) in a constant number of operations (`total` is the
    sum of `counts`, known to the caller: no host sync): the rows of some blocks from their first rows."""
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    ends = torch.cumsum(counts, 0)
    offsets = torch.repeat_interleave(starts - (ends - counts), counts, output_size=total)
    return offsets + torch.arange(total, device=starts.device)


def cut_blocks(means: torch.Tensor, scales: torch.Tensor, block_size: int, cut: str, world_size: int,
               counts: Sequence[int] | None = None) -> Tuple[torch.Tensor, "BlockTable"]:
    """Lay Gaussians out in blocks (k-d leaves or Morton runs of at most `block_size`; with `counts`, the rows
    are in block order already and the blocks are those runs) and assign owners (contiguous shares of the
    Gaussians); `scales` not log. (the rows' order, the table at version 0)."""
    if counts is not None:
        order = torch.arange(means.shape[0], device=means.device)
        counts = torch.as_tensor(list(counts), dtype=torch.int64)
    else:
        layout = build_layout(means, scales, block_size=block_size, cut=cut)
        order, counts = layout.order.to(means.device), layout.counts.clone()
    owner = torch.as_tensor(assign_contiguous(counts.numpy().astype(float), world_size).owner, dtype=torch.int64)
    block_of = torch.repeat_interleave(torch.arange(len(counts)), counts)
    lo, hi, _, _, max_scale = block_bounds(means[order], scales[order], block_of, len(counts))
    return order, BlockTable(owner=owner, count=counts, lo=lo, hi=hi, max_scale=max_scale,
                             version=torch.zeros(len(counts), dtype=torch.int64))
