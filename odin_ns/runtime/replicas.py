"""A rank's replicas of other ranks' blocks: one arena per phase, holding a block only while the rank's views read
it within the publication window.

The plan says, for every remote block b and every update u of the phase, whether the owner's publication of u
brings b to this rank: it does when one of the rank's views reads b at a step of u's window (u+1 .. u+1+staleness,
`PhasePlan.pub_blocks`). A run of consecutive such publications is one stay of b in the arena: its first
publication carries the whole block, the later ones only the rows the update changed (a row no update changed since
the run began equals the copy held). Outside its runs b takes no memory: the arena holds at most the blocks read in
the window (plus what a first-fit placement of the stays wastes), not every block the rank ever read.

Everything here is planned once per phase, as arrays; a step only gathers and scatters rows with a constant number
of tensor operations whatever the number of blocks:
- `slot_at[i, b]`: the arena row where block b starts while step start+i may read it (-1: not held);
- `pub_slot[u - start + 1, b]`: where publication u writes block b;
- `view_sources`: for a view, the source of each of its rows (owned row or arena row) in ascending block order,
  the order in which every rank and the one-process reference render them.
Written here: no library plans a first-fit arena for intervals of block stays.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch


def expand_ranges(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """cat(arange(s, s + c) for s, c in zip(starts, counts)) in a constant number of operations (`total` is the
    sum of `counts`, known to the caller: no host sync)."""
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    ends = torch.cumsum(counts, 0)
    offsets = torch.repeat_interleave(starts - (ends - counts), counts, output_size=total)
    return offsets + torch.arange(total, device=starts.device)


class ArenaPlan:
    """Where each remote block lives in this rank's arena during one phase (see the module docstring)."""

    def __init__(self, start: int, stop: int, reads: torch.Tensor, owner: torch.Tensor, count: torch.Tensor,
                 me: int, staleness: int):
        """`reads[i, b]`: some view of this rank reads block b at step start+i (bool [S, B])."""
        S, B = reads.shape
        self.start, self.stop, self.staleness = start, stop, staleness
        remote = (owner != me) & (count > 0)
        mine = reads & remote[None, :]
        # pub[u - start + 1, b]: the publication of update u (start-1 .. stop-2) brings b (its window reads it)
        pub = torch.zeros((S, B), dtype=torch.bool)
        for k in range(staleness + 1):  # window u+1 .. u+1+staleness: reads of steps i .. i+staleness
            pub[: S - k] |= mine[k:]
        self.pub = pub
        self.slot_at = torch.full((S, B), -1, dtype=torch.int64)
        self.pub_slot = torch.full((S, B), -1, dtype=torch.int64)
        self.full = torch.zeros((S, B), dtype=torch.bool)  # publication u carries the whole block (a stay begins)
        counts = count.tolist()
        stays: List[Tuple[int, int, int, int, int]] = []  # (first step held, last step held, block, first u, last u)
        for b in torch.nonzero(pub.any(dim=0)).flatten().tolist():
            column = pub[:, b].tolist()
            reads_b = mine[:, b].tolist()
            i = 0
            while i < S:
                if not column[i]:
                    i += 1
                    continue
                j = i
                while j + 1 < S and column[j + 1]:
                    j += 1
                # publications (indices) i..j: updates start-1+i .. start-1+j; held from step i (the first
                # publication is taken at step i at the earliest) to the last read its publications serve
                last_read = max(t for t in range(i, min(S, j + staleness + 1)) if reads_b[t])
                stays.append((i, last_read, b, i, j))
                i = j + 1
        # first fit, stays in order of their first step: a slot is free again after the last step of its stay
        stays.sort()
        free: List[Tuple[int, int]] = []  # (start, size) of free arena ranges
        busy: List[Tuple[int, int, int]] = []  # (last step, start, size)
        top = 0
        for first, last, b, u0, u1 in stays:
            for done in [x for x in busy if x[0] < first]:
                busy.remove(done)
                free.append((done[1], done[2]))
            free = _merge(free)
            n = counts[b]
            place = next((k for k, (s, size) in enumerate(free) if size >= n), None)
            if place is None:
                where, top = top, top + n
            else:
                s, size = free.pop(place)
                where = s
                if size > n:
                    free.append((s + n, size - n))
            busy.append((last, where, n))
            self.slot_at[first:last + 1, b] = where
            self.pub_slot[u0:u1 + 1, b] = where
            self.full[u0, b] = True
        self.capacity = top
        # rows of the remote blocks read in each publication's window (the least any replica store holds then)
        self.window_rows = torch.where(pub, count.to(torch.int64)[None, :], 0).sum(dim=1)

    def index(self, update: int) -> int:
        """The row of publication `update` (start-1 .. stop-2) in `pub`, `pub_slot`, `window_rows`."""
        return update - self.start + 1


def _merge(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for s, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


class Arena:
    """The rows of the remote blocks held this phase ([capacity, D] packed parameters)."""

    def __init__(self, plan: ArenaPlan, width: int, device: torch.device):
        self.plan = plan
        self.rows = torch.zeros((plan.capacity, width), dtype=torch.float32, device=device)
        self._dest: Dict[Tuple[int, int], torch.Tensor] = {}

    def destination(self, update: int, owner: int, blocks: torch.Tensor, counts: torch.Tensor, total: int
                    ) -> torch.Tensor:
        """Arena row of every row of a publication (its blocks' rows concatenated in ascending block order)."""
        key = (update, owner)
        if key not in self._dest:
            starts = self.plan.pub_slot[self.plan.index(update)][blocks].to(self.rows.device)
            self._dest[key] = expand_ranges(starts, counts.to(self.rows.device), total)
        return self._dest[key]

    def apply(self, dest: torch.Tensor, index: torch.Tensor, columns: Optional[torch.Tensor],
              values: torch.Tensor) -> None:
        """Write received rows (`index` into the message's rows) into the arena, only the columns that travelled."""
        where = dest[index]
        if columns is None:
            self.rows.index_copy_(0, where, values)
        else:
            self.rows[where[:, None], columns[None, :]] = values
