"""Wait and traffic accounting: per rank and step, compute time, wait time by cause, bytes moved.

Causes (DESIGN.md, "Measuring"): `validate` (a view waiting for the publications of the blocks it reads),
`transfer` (an owner waiting for its readers' gradients), `barrier` (the global synchronization of a step,
odin-barrier only), `phase` (the synchronization, densify/prune/rebalance and planning at a phase boundary),
`gather` (collecting the whole model on rank 0 for checkpoints and the viewer, and an evaluation's splats).

Every second of a step's wall (from the start of one step to the start of the next) is in exactly one part:
`render_s` (forward, loss, backward), `update_s` (summing contributions, selective Adam), the waits, and the
rest: `bookkeeping_s` inside the step (plans, read sets, packing, checks) and `loop_s`, nerfstudio's own work: its
trainer loop outside the step (logging, callbacks, the viewer) and the step's call of its schedulers (`nerfstudio`).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List

from odin_ns.runtime.held_bytes import HeldBytes

CAUSES = ("validate", "transfer", "barrier", "phase", "gather")


@dataclass
class StepRecord:
    step: int
    rank: int
    views: List[int] = field(default_factory=list)
    compute_s: float = 0.0  # render: forward + loss + backward
    update_s: float = 0.0
    bookkeeping_s: float = 0.0
    loop_s: float = 0.0
    plan_s: float = 0.0  # of the phase wait: this rank's planning of a phase that starts at the step (its own work)
    wall_s: float = 0.0
    started: float = 0.0  # time.perf_counter() (CLOCK_MONOTONIC: comparable across the ranks of one machine)
    # processor time of the rank's process over the step (every thread: the renders, a lane on a thread, the
    # transport's own threads): the work done whichever thread did it, none of the waiting
    cpu_s: float = 0.0
    wait_s: Dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    bytes_sent: int = 0
    bytes_received: int = 0
    # bytes sent by what they carry: "P" (reads: rows or splats to the readers), "G" (gradients to the owners)
    bytes_by_kind: Dict[str, int] = field(default_factory=dict)
    remote_pairs: int = 0  # visible (view, Gaussian of another rank) pairs this rank's views rendered
    receives: int = 0  # receives the rank posted in the step
    receives_ahead: int = 0  # of them, posted before a handler needed them (`runtime.inbox`)
    # the most bytes of message buffers (sent, received, a view's gradients from its backward on) alive at once in
    # the step (`runtime.held_bytes`)
    message_bytes: int = 0
    # bytes the rank holds for training at the step: owned rows with their two Adam moments, and the most its
    # message buffers held at once (`message_bytes`); no rank holds another rank's rows
    resident_bytes: int = 0
    # the most the owner's projections held in the step (each kept graph: its leaves and the tensors its backward
    # reads; or, projected again at the update, the splats and one pair's graph; a read behind's copy of its rows):
    # not in resident_bytes, which counts what the targets name (parameters, moments, messages)
    projection_bytes: int = 0
    # the owner's projections made in the step: with their graph kept, and with their splats only (made again at
    # the update: `runtime.projection_memory`)
    projections_kept: int = 0
    projections_again: int = 0
    # rank 0 of several: the renders of nerfstudio's evaluation after the step, each from every owner's splats
    # (`runtime.eval_splats`)
    eval_renders: int = 0
    row_bytes: int = 0  # bytes of one Gaussian's packed parameters (one process holds 3x that per Gaussian with Adam)
    gaussians_owned: int = 0
    blocks_read: int = 0
    blocks_total: int = 0
    loss: float = 0.0
    read_set_misses: int = 0
    misses_handled: int = 0
    plan_violations: int = 0
    phase_start: bool = False
    # throughput-first: reads admitted behind ({owner, staleness, blocks, estimate, skipped}: the versions behind,
    # the blocks read, the evidence k x last update size, the largest relative size of the updates it skipped)
    # and block reads refused (the read waited for the newest version)
    stale_reads: List[dict] = field(default_factory=list)
    stale_refused: int = 0
    # throughput-first: the owner update thread's time during the step (beside the render, not on its path)
    background_s: Dict[str, float] = field(default_factory=lambda: {"update": 0.0, "transfer": 0.0})
    segments: List[list] = field(default_factory=list)  # [kind, start offset s, duration s] for timelines
    # the runtime's side of the step (validate, publish), counted when asked (runtime.op_count): tensor operations
    # dispatched and host syncs among them; None when not counted
    runtime_ops: int | None = None
    runtime_syncs: int | None = None

    def to_dict(self) -> dict:
        return {
            "step": self.step, "rank": self.rank, "views": self.views, "compute_s": self.compute_s,
            "update_s": self.update_s, "bookkeeping_s": self.bookkeeping_s, "loop_s": self.loop_s,
            "plan_s": self.plan_s,
            "wall_s": self.wall_s, "started": self.started, "cpu_s": self.cpu_s,
            "wait_s": dict(self.wait_s), "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
            "bytes_by_kind": dict(self.bytes_by_kind), "remote_pairs": self.remote_pairs,
            "receives": self.receives, "receives_ahead": self.receives_ahead,
            "message_bytes": self.message_bytes, "resident_bytes": self.resident_bytes, "row_bytes": self.row_bytes,
            "projection_bytes": self.projection_bytes,
            "projections_kept": self.projections_kept, "projections_again": self.projections_again,
            "eval_renders": self.eval_renders, "gaussians_owned": self.gaussians_owned,
            "blocks_read": self.blocks_read, "blocks_total": self.blocks_total, "loss": self.loss,
            "read_set_misses": self.read_set_misses, "misses_handled": self.misses_handled,
            "plan_violations": self.plan_violations, "phase_start": self.phase_start,
            "stale_reads": [dict(e) for e in self.stale_reads], "stale_refused": self.stale_refused,
            "background_s": dict(self.background_s),
            "segments": [[k, round(a, 6), round(d, 6)] for k, a, d in self.segments],
            "runtime_ops": self.runtime_ops, "runtime_syncs": self.runtime_syncs,
        }


class WaitLog:
    """The records of one rank; `current` is the step being run."""

    def __init__(self, rank: int):
        self.rank = rank
        self._thread = threading.get_ident()  # the render thread; another (the update thread) counts apart
        self.records: List[StepRecord] = []
        self.current = StepRecord(step=-1, rank=rank)
        self._nerfstudio_s = 0.0  # of the current step: nerfstudio's work inside it (`nerfstudio`)
        self.held = HeldBytes()  # the rank's message buffers alive (the channels', the exchanges', the gradients')

    def begin(self, step: int) -> StepRecord:
        now = time.perf_counter()
        self.close(now)
        self.current = StepRecord(step=step, rank=self.rank, started=now)
        self._cpu_started = time.process_time()
        self.records.append(self.current)
        self._inside = now
        self._nerfstudio_s = 0.0
        return self.current

    def end_inside(self) -> None:
        """The step's own work is done (nerfstudio's loop takes over until the next `begin`)."""
        r = self.current
        inside = time.perf_counter() - self._inside - self._nerfstudio_s
        self._waited_inside = sum(r.wait_s.values())
        r.bookkeeping_s = max(0.0, inside - r.compute_s - r.update_s - self._waited_inside)
        self._inside_s = inside

    def close(self, now: float | None = None) -> None:
        """Close the current step at `now`: its wall, and the loop time outside it that no wait explains."""
        r = self.current
        if r.step < 0 or r.wall_s:
            return
        now = time.perf_counter() if now is None else now
        r.wall_s = now - r.started
        r.cpu_s = time.process_time() - getattr(self, "_cpu_started", time.process_time())
        outside_waits = sum(r.wait_s.values()) - getattr(self, "_waited_inside", 0.0)
        r.loop_s = max(0.0, r.wall_s - getattr(self, "_inside_s", r.wall_s) - outside_waits)

    @contextmanager
    def waiting(self, cause: str) -> Iterator[None]:
        """Time spent blocked, by cause; a wait inside another counts once, under the outer cause."""
        if threading.get_ident() != self._thread:
            with self._background("transfer"):
                yield
            return
        if getattr(self, "_depth", 0):
            yield
            return
        self._depth = 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self._depth = 0
            self._segment(cause, started)

    @contextmanager
    def nerfstudio(self) -> Iterator[None]:
        """nerfstudio's own work that the step calls (its schedulers' step, which its trainer makes after the
        optimizers' and one process of splatfacto makes too): counted with the loop, not the runtime's bookkeeping.
        Off the render thread (a lane's update on a thread) the step's parts do not count it, as they do not count
        the rest of the lane's time outside its updates and renders."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if threading.get_ident() == self._thread:
                self._nerfstudio_s += time.perf_counter() - started

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Render work; off the render thread (an owner's projections on the communication lane) it runs beside
        the renders and counts apart."""
        if threading.get_ident() != self._thread:
            with self._background("render"):
                yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self.current.compute_s += self._segment("render", started)

    @contextmanager
    def _background(self, kind: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            record = self.current
            record.background_s[kind] = record.background_s.get(kind, 0.0) + time.perf_counter() - started

    @contextmanager
    def updating(self) -> Iterator[None]:
        if threading.get_ident() != self._thread:
            with self._background("update"):
                yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self.current.update_s += self._segment("update", started)

    def _segment(self, kind: str, started: float) -> float:
        """Record [kind, offset, duration] in the current step (waits also add to their cause); the duration."""
        duration = time.perf_counter() - started
        r = self.current
        if kind in r.wait_s:
            r.wait_s[kind] += duration
        if len(r.segments) < 64:
            r.segments.append([kind, started - r.started, duration])
        return duration

    def add_traffic(self, sent: int, received: int, kind: str | None = None) -> None:
        self.current.bytes_sent += sent
        self.current.bytes_received += received
        if kind is not None and sent:
            self.current.bytes_by_kind[kind] = self.current.bytes_by_kind.get(kind, 0) + sent
