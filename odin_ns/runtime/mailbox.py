"""Asynchronous point-to-point messages of a phase: a small int64 header, then the rows it announces.

Inside a phase every rank knows which messages it will get and from whom (the plan), but not how many rows each
carries (only the rows that changed travel), so each message is two: a header of per-entry row counts, whose
length the plan fixes, then, if any row is announced, one float tensor with them. Sends are `isend`s that the
sender never waits for inside the phase (it only forgets those that completed); receives wait, and their time is
the wait of the named cause. Messages of one kind between two ranks arrive in the order they were sent (one
gloo/NCCL tag per kind), so no sequence number is needed.
"""

from __future__ import annotations

import threading
from typing import List, Tuple

import torch
import torch.distributed as dist

from odin_ns.runtime.waits import WaitLog

TAG_GRAD = 11  # gradient rows, reader -> owner
TAG_PUBLISH = 12  # changed rows of a new block version, owner -> reader
TAG_EXTRA = 13  # ids of blocks added to a read set after a detected miss, owner -> reader


class Mailbox:
    """The pending sends of one rank and the receives it waits for."""

    def __init__(self, device: torch.device, log: WaitLog):
        self.device = device
        self.log = log
        self._pending: List[Tuple[dist.Work, torch.Tensor]] = []
        self._lock = threading.Lock()  # the render thread sends gradients while the update thread publishes

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.contiguous()
        with self._lock:
            self._pending.append((dist.isend(tensor, peer, tag=tag), tensor))
        self.log.add_traffic(tensor.numel() * tensor.element_size(), 0)

    def send_ints(self, values: torch.Tensor, peer: int, tag: int) -> None:
        self._isend(values.to(self.device, torch.int64), peer, tag)

    def send_rows(self, rows: torch.Tensor, peer: int, tag: int) -> None:
        """Rows announced by a header sent before (nothing is sent for zero rows: the header says so)."""
        if rows.shape[0]:
            self._isend(rows, peer, tag)
        with self._lock:
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv_ints(self, n: int, peer: int, tag: int, cause: str) -> torch.Tensor:
        values = torch.empty(n, dtype=torch.int64, device=self.device)
        with self.log.waiting(cause):
            dist.irecv(values, peer, tag=tag).wait()
        self.log.add_traffic(0, values.numel() * values.element_size())
        return values.cpu()

    def recv_rows(self, n: int, width: int, dtype: torch.dtype, peer: int, tag: int, cause: str) -> torch.Tensor:
        rows = torch.empty((n, width), dtype=dtype, device=self.device)
        if n:
            with self.log.waiting(cause):
                dist.irecv(rows, peer, tag=tag).wait()
            self.log.add_traffic(0, rows.numel() * rows.element_size())
        return rows

    def flush(self, cause: str = "phase") -> None:
        """Wait until every send has been taken (at a phase boundary, where every receive has been posted)."""
        with self._lock:
            pending, self._pending = self._pending, []
        with self.log.waiting(cause):
            for work, _ in pending:
                work.wait()
