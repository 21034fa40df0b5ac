"""Wait and traffic accounting: per rank and step, compute time, wait time by cause, bytes moved.

Causes (DESIGN.md, "Measuring"): `barrier` (the global synchronization of a step), `fetch` (replicas of remote
blocks arriving), `transfer` (gradients and statistics reaching owners), `phase` (densify/prune/rebalance at a
phase boundary), `gather` (collecting the whole model on rank 0 for checkpoints, evaluation and the viewer).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List

CAUSES = ("barrier", "fetch", "transfer", "phase", "gather")


@dataclass
class StepRecord:
    step: int
    rank: int
    views: List[int] = field(default_factory=list)
    compute_s: float = 0.0
    wait_s: Dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    bytes_sent: int = 0
    bytes_received: int = 0
    gaussians_owned: int = 0
    gaussians_replicated: int = 0
    blocks_read: int = 0
    blocks_total: int = 0
    loss: float = 0.0
    read_set_misses: int = 0

    def to_dict(self) -> dict:
        return {
            "step": self.step, "rank": self.rank, "views": self.views, "compute_s": self.compute_s,
            "wait_s": dict(self.wait_s), "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "gaussians_owned": self.gaussians_owned, "gaussians_replicated": self.gaussians_replicated,
            "blocks_read": self.blocks_read, "blocks_total": self.blocks_total, "loss": self.loss,
            "read_set_misses": self.read_set_misses,
        }


class WaitLog:
    """The records of one rank; `current` is the step being run."""

    def __init__(self, rank: int):
        self.rank = rank
        self.records: List[StepRecord] = []
        self.current = StepRecord(step=-1, rank=rank)

    def begin(self, step: int) -> StepRecord:
        self.current = StepRecord(step=step, rank=self.rank)
        self.records.append(self.current)
        return self.current

    @contextmanager
    def waiting(self, cause: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.current.wait_s[cause] += time.perf_counter() - started

    @contextmanager
    def computing(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.current.compute_s += time.perf_counter() - started

    def add_traffic(self, sent: int, received: int) -> None:
        self.current.bytes_sent += sent
        self.current.bytes_received += received
