"""Odin's view order: the same views per epoch as nerfstudio's, grouped so that concurrent views share few blocks,
and placed on ranks so that every rank's summed cost stays balanced.

Each epoch is nerfstudio's seeded permutation of the training views (`ViewSchedule`'s), so every view is seen
once per epoch. Within an epoch the views are regrouped into global batches (one step's views on all ranks):
a batch starts with the earliest view not yet placed and is filled, one by one, with the view from the next
`window` of the permutation that shares the fewest blocks with the views already in the batch (ties: the
earliest). Views that run at the same time then touch few common blocks, which is what lets the exact path
run ranks apart. Then each step's views go to ranks by decreasing cost, each to the rank with the lowest summed
cost so far that still has a free slot (longest-processing-time first, over the whole run: the exact path lets
ranks drift inside a phase, so balance is kept over many steps, not within each), unless the view's home slot
is free and its load is within `slack` mean view costs of that lowest one: then it goes home. A view's home is
the slot whose share of the blocks (a contiguous cut of the Morton blocks into one share per global slot, which
is how the initial ownership cuts them per rank) holds most of the Gaussians it reads, so a rank mostly renders
views of the blocks it owns and waits less for the others. Loads are kept per global
slot (rank r holds slots r*B .. r*B+B-1 with a micro-batch of B), so the order does not depend on how the
global batch is split into ranks.

Locality and costs come from the initial model (read sets of its blocks and their Gaussian counts): they are
known before training, identical on every rank and after a resume. The order depends only on the global batch
size, so one rank with a micro-batch of N views runs the same global batches as N ranks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Sequence


@dataclass
class OdinSchedule:
    """Views per (step, rank); same interface as `ViewSchedule`."""

    num_views: int
    num_ranks: int
    micro_batch: int
    seed: int
    view_blocks: Sequence[frozenset]  # per training view: the blocks it reads
    costs: Sequence[float]  # per training view: its predicted cost
    view_home: Sequence[int] = ()  # per training view: the global slot whose blocks it reads most (or none)
    window: int = 0  # 0: four global batches
    slack: float = 4.0  # a view goes to its home slot while that slot's load is within slack x mean cost
    _stream: List[int] = field(default_factory=list, repr=False, compare=False)
    _steps: List[List[List[int]]] = field(default_factory=list, repr=False, compare=False)
    _loads: List[float] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_views < 1:
            raise ValueError("a schedule needs at least one training view")
        if self.num_ranks < 1 or self.micro_batch < 1:
            raise ValueError("ranks and micro-batch must be at least 1")
        if len(self.view_blocks) != self.num_views or len(self.costs) != self.num_views:
            raise ValueError("view_blocks and costs need one entry per training view")
        if self.view_home and len(self.view_home) != self.num_views:
            raise ValueError("view_home needs one entry per training view")
        self._tolerance = self.slack * sum(self.costs) / self.num_views
        self._rng = random.Random(self.seed)
        self._loads = [0.0] * self.global_batch  # per global slot (rank r holds slots r*B .. r*B+B-1)

    @property
    def global_batch(self) -> int:
        return self.num_ranks * self.micro_batch

    def _add_epoch(self) -> None:
        order = list(range(self.num_views))
        self._rng.shuffle(order)  # nerfstudio's permutation (the same draws as ViewSchedule)
        G = self.global_batch
        window = self.window or 4 * G
        first = (G - len(self._stream) % G) % G or G  # the step boundary the epoch starts in
        remaining = order
        out: List[int] = []
        size = first
        while remaining:
            group = [remaining.pop(0)]
            while len(group) < size and remaining:
                candidates = remaining[:window]
                shared = [sum(len(self.view_blocks[c] & self.view_blocks[g]) for g in group) for c in candidates]
                best = min(range(len(candidates)), key=lambda k: (shared[k], k))
                group.append(remaining.pop(best))
            out.extend(group)
            size = G
        self._stream.extend(out)

    def _step(self, step: int) -> List[List[int]]:
        G, B = self.global_batch, self.micro_batch
        while len(self._steps) <= step:
            t = len(self._steps)
            while len(self._stream) < (t + 1) * G:
                self._add_epoch()
            batch = self._stream[t * G:(t + 1) * G]
            slots: List[int] = [-1] * G
            for v in sorted(batch, key=lambda v: (-self.costs[v], batch.index(v))):
                free = [k for k in range(G) if slots[k] < 0]
                k = min(free, key=lambda k: (self._loads[k], k))
                home = self.view_home[v] if self.view_home else -1
                if home in free and self._loads[home] <= self._loads[k] + self._tolerance:
                    k = home
                slots[k] = v
                self._loads[k] += self.costs[v]
            per_rank = [slots[r * B:(r + 1) * B] for r in range(self.num_ranks)]
            self._steps.append(per_rank)
        return self._steps[step]

    def views(self, step: int, rank: int) -> List[int]:
        return list(self._step(step)[rank])

    def global_views(self, step: int) -> List[List[int]]:
        return [list(v) for v in self._step(step)]

    def to_rows(self, first_step: int, num_steps: int) -> List[Dict[str, int]]:
        rows = []
        for step in range(first_step, first_step + num_steps):
            for rank in range(self.num_ranks):
                for slot, view in enumerate(self.views(step, rank)):
                    rows.append({"step": step, "rank": rank, "slot": slot, "view": view})
        return rows
