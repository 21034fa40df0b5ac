"""A clean stop on Ctrl+C: every rank stops after the same step, at a synchronization point, and rank 0 saves.

Ranks cannot each stop where the signal finds them: their peers would wait forever on a collective (or on a
publication) of a step that never comes. So Ctrl+C only marks a request; at the end of every phase (a global
synchronization point, every update applied) the ranks agree on it with one all-reduce, and all of them stop after
that step. Alone, a request is honoured after the current step.

A request comes from SIGINT to the rank itself (torchrun forwards the signal it gets; `ns-train` gets it from the
terminal) or from the stop file that `odin-train` touches on Ctrl+C (it keeps the terminal's signal from torchrun,
which would otherwise tear the ranks down). A second SIGINT (a second Ctrl+C, not torchrun's copy of the first
arriving right after it) stops the rank at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

STOP_FILE_ENV = "ODIN_STOP_FILE"
EXIT_INTERRUPTED = 130
SECOND_PRESS_S = 1.0  # a second SIGINT sooner than this is the same Ctrl+C arriving by a second path


class StopRequest:
    """This rank's stop request (signal or stop file) and the ranks' agreement on it."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.requested_at: float | None = None
        self.stop_file = os.environ.get(STOP_FILE_ENV)

    def install(self) -> None:
        """Handle SIGINT from now on (the main thread only can; elsewhere Ctrl+C keeps its default)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):  # noqa: ARG002 (signal handler signature)
        now = time.monotonic()
        if self.requested_at is None:
            self.requested_at = now
            if self.rank == 0 and not self.stop_file:  # odin-train says it itself
                sys.stderr.write("odin: Ctrl+C: stopping at the next synchronization point (alone: after this step) "
                                 "and writing a checkpoint (Ctrl+C again stops at once, without one)\n")
        elif now - self.requested_at > SECOND_PRESS_S:
            sys.stderr.write(f"odin: rank {self.rank}: stopped at once by a second Ctrl+C\n")
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)

    @property
    def local(self) -> bool:
        """Has this rank been asked to stop (by a signal, or by the launcher's stop file)?"""
        if self.requested_at is None and self.stop_file and os.path.exists(self.stop_file):
            self.requested_at = time.monotonic()
        return self.requested_at is not None

    def agreed(self, distributed: bool, device: torch.device) -> bool:
        """Collective when distributed (every rank calls it at the same point): does any rank want to stop?"""
        flag = self.local
        if not distributed:
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
