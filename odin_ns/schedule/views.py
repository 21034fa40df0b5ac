"""The view order of training: one global sequence, cut into global batches of ranks x micro-batch views.

Step t's global batch is the views `seq[t*G : (t+1)*G]` (G = ranks * micro_batch), rank r taking the slice
`[r*B, (r+1)*B)` of it. The sequence is nerfstudio's: epochs of seeded permutations of the training views, drawn
with `random.Random(seed)` exactly as `FullImageDatamanager.sample_train_cameras` does, so that one rank with
micro-batch 1 sees the views in the order plain nerfstudio would. The same global batch on N ranks or on one rank
with micro-batch N is the same training (DESIGN.md, semantics 1).
"""

from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class ViewSchedule:
    """Views per (step, rank), generated lazily epoch by epoch; printable, serializable, comparable."""

    num_views: int
    num_ranks: int = 1
    micro_batch: int = 1
    seed: int = 42
    _epochs: List[List[int]] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_views < 1:
            raise ValueError("a schedule needs at least one training view")
        if self.num_ranks < 1 or self.micro_batch < 1:
            raise ValueError("ranks and micro-batch must be at least 1")
        self._rng = random.Random(self.seed)

    @property
    def global_batch(self) -> int:
        return self.num_ranks * self.micro_batch

    def _position(self, index: int) -> int:
        epoch, offset = divmod(index, self.num_views)
        while len(self._epochs) <= epoch:
            order = list(range(self.num_views))
            self._rng.shuffle(order)
            self._epochs.append(order)
        return self._epochs[epoch][offset]

    def views(self, step: int, rank: int) -> List[int]:
        """The training-view indices rank `rank` renders at `step`, in order."""
        start = (step * self.num_ranks + rank) * self.micro_batch
        return [self._position(start + j) for j in range(self.micro_batch)]

    def global_views(self, step: int) -> List[List[int]]:
        """Every rank's views at `step` (rank order)."""
        return [self.views(step, r) for r in range(self.num_ranks)]

    def to_rows(self, first_step: int, num_steps: int) -> List[Dict[str, int]]:
        rows = []
        for step in range(first_step, first_step + num_steps):
            for rank in range(self.num_ranks):
                for slot, view in enumerate(self.views(step, rank)):
                    rows.append({"step": step, "rank": rank, "slot": slot, "view": view})
        return rows

    def to_csv(self, first_step: int, num_steps: int) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=["step", "rank", "slot", "view"])
        writer.writeheader()
        writer.writerows(self.to_rows(first_step, num_steps))
        return out.getvalue()
