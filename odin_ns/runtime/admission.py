"""Throughput-first's reads behind (DESIGN.md semantics 4): admission, the owners' replay of it, its notes.

A read of an owner's blocks at step t may render the version of an earlier update when the plan's overlap test
and the published evidence (each block's last update size relative to its norm) admit it. Two sides decide it
alike, from the same plan and the same evidence, so that no request ever travels:
- the reader (`take_admitted`, `own_admitted` for its own blocks): it takes the owner's publications in order
  until the read is current or admitted;
- the owner (`decide_reads`): it replays each reader's decision, to project every read when its version is current
  (`runtime.splat_path`) and to know which reads a block that left its planned bounds can still reach.
The notes (`note_read`, `note_skipped`) put what was admitted, refused and skipped into the steps' records.

The evidence lives on the host as Python floats, a number per block: the decisions are host control flow, and a
tiny tensor's max read back costs a host read each (fourteen a step, where the exact policies make two). An update
leaves its blocks' sums of squared change on the device (`record_evidence`); they come back in the host read the
bounds check after the update makes anyway (`settle_evidence`), and everything after is arithmetic on floats.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch


def largest(rel: Sequence[float], blocks: Sequence[int]) -> float:
    """The largest evidence of `blocks` (0.0 for none); NaN if any is NaN, as a tensor's `max` gives it (Python's
    `max` would pass over it), so that such a read is refused (k * NaN <= threshold is false)."""
    out = 0.0
    for b in blocks:
        value = rel[b]
        if value != value:
            return value
        if value > out:
            out = value
    return out


def block_sums(values: torch.Tensor, keys: torch.Tensor, count: int, segmented: Optional[bool] = None
               ) -> torch.Tensor:
    """[count] float64: the sum of `values` per key (`keys` non-decreasing, each in [0, count)), every key's values
    added in their order. On the CPU an `index_add_`; elsewhere (`segmented`) a sum per segment (a key's values are
    contiguous), where `index_add_` adds with atomics in an order that varies from run to run, and
    throughput-first must decide alike on every run."""
    if not (values.device.type != "cpu" if segmented is None else segmented):
        return torch.zeros(count, dtype=torch.float64, device=values.device).index_add_(0, keys, values)
    offsets = torch.searchsorted(keys, torch.arange(count + 1, device=keys.device))
    return torch.segment_reduce(values, "sum", offsets=offsets, unsafe=True)


def evidence_from_wire(words: Sequence[int]) -> List[float]:
    """A header's evidence, sent as the int64 words of float64 values, back to floats (bit for bit)."""
    return list(struct.unpack(f"{len(words)}d", struct.pack(f"{len(words)}q", *words)))


def evidence_to_wire(values: Sequence[float]) -> torch.Tensor:
    """float64 values as int64 words, to travel in an int64 header (bit for bit)."""
    return torch.tensor(values, dtype=torch.float64).view(torch.int64)


class ReadAdmission:
    """The admission state of one rank in a phase; `RankRuntime` holds it (plan, env, channels, splats)."""

    def _init_admission(self, admit_update: float) -> None:
        self.admit_update = admit_update
        # per block, the relative size of its last update (own blocks), as published (remote blocks), and per
        # update the owner's values after it; unknown (inf) after a structural change
        self.rel_now: List[float] = []
        self._structural = True
        self._pending: Optional[Tuple[int, torch.Tensor]] = None  # an update's block sums, not yet read
        self._notes = threading.Lock()
        self._step_notes: Dict[int, tuple] = {}

    def structural_change(self) -> None:
        """Blocks or values changed outside the optimizer (refine, opacity reset): the evidence is unknown."""
        self._structural = True

    def evidence_of(self, blocks: Sequence[int]) -> Dict[int, float]:
        """`blocks`' evidence as a checkpoint keeps it: inf (unknown) after a structural change (a checkpoint at a
        refine step comes after it, and the blocks may be others by then), the last update's size otherwise."""
        if self._structural:
            return {b: math.inf for b in blocks}
        return {b: self.rel_now[b] for b in blocks}

    def _begin_admission(self, plan, own_norm_sq: List[float]) -> None:
        """A phase's state: the evidence carried over (unless structure changed), the readers' positions."""
        me, R, B = self.env.rank, plan.num_ranks, plan.num_blocks
        if self._structural or len(self.rel_now) != B:
            self.rel_now = [math.inf] * B
            self._structural = False
        self.rel_hist = {plan.start - 1: list(self.rel_now)}
        self.held = plan.start - 1  # the version of this rank's parameters (its last update)
        self._pending = None
        self.rel_seen = [math.inf] * B
        self.pos: Dict[int, Optional[int]] = {o: None for o in range(R) if o != me}
        self.queued: Dict[int, List[tuple]] = {}  # owner -> publications received ahead (`drain`)
        # the owner's replay of the reads of its blocks (`decide_reads`): per rank the version its last decided
        # read takes and its first undecided step; per (step, rank) the version decided
        self.sim_pos: Dict[int, Optional[int]] = {q: plan.start - 1 if q == me else None for q in range(R)}
        self.next_read: Dict[int, int] = dict.fromkeys(range(R), plan.start)
        self.read_version: Dict[Tuple[int, int], int] = {}
        self.open_stale: Dict[int, list] = {}
        self.norm_sq = own_norm_sq  # per owned block, its squared norm at the phase start

    def record_evidence(self, step: int, delta_sq: Optional[torch.Tensor], rows: torch.Tensor) -> None:
        """After this rank's update of `step`: each owned block's sum of its rows' squared change, on the device,
        until `settle_evidence` reads it (an update that touched no row changed nothing)."""
        self.settle_evidence()  # the update before's, if nothing has read it yet
        self.held = step
        if delta_sq is not None and self.n_owned and rows.numel():  # `rows` ascending: their blocks non-decreasing
            sums = block_sums(delta_sq, self.row_local.index_select(0, rows), len(self.own_blocks))
            self._pending = (step, sums)
        else:
            self._pending = (step, None)

    def pending_evidence(self) -> Optional[torch.Tensor]:
        """The last update's block sums not yet read (for the bounds check's host read to bring back)."""
        return self._pending[1] if self._pending is not None else None

    def settle_evidence(self, sums: Optional[List[float]] = None) -> None:
        """The last update's evidence on the host: each owned block it changed gets its update's size relative to
        its norm at the phase start, sqrt(sum / norm^2); `sums` as read with the bounds check, else read here."""
        if self._pending is None:
            return
        step, pending = self._pending
        self._pending = None
        if pending is not None:
            for b, d, norm_sq in zip(self.own_blocks, pending.tolist() if sums is None else sums, self.norm_sq):
                if d > 0:
                    self.rel_now[b] = math.sqrt(d / max(norm_sq, 1e-30))
        self.rel_hist[step] = list(self.rel_now)
        self.note_skipped(self.env.rank, step, self.rel_now)

    def admits(self, step: int, reader: int, owner: int, pos: int, rel: float) -> bool:
        """May `reader`'s read of `owner`'s blocks at `step` use the version of update `pos`? The plan's overlap
        test, and the evidence: k (versions behind) times the largest relative size of the last update of the
        blocks read (`rel`, as published with update `pos`) at most `admit_update`. A block whose size is
        unknown (after a structural change) or that left its planned bounds has size inf: never admitted."""
        k = step - 1 - pos
        if not self.plan.schedule_admits(step, reader, owner, k):
            return False
        return k * rel <= self.admit_update

    def take_admitted(self, step: int, owner: int, until: int) -> bool:
        """Throughput-first read of `owner`'s blocks at `step`: take its publications up to update `until` until
        the read is current or admitted behind; whether it is decided (False: it waits for a later one)."""
        plan, me = self.plan, self.env.rank
        blocks = plan.publish_blocks(step, owner, me)
        p, tested, done = plan.advance(
            step, me, owner, self.pos[owner], admitted=lambda pos: self.admits(
                step, me, owner, pos, largest(self.rel_seen, blocks)), take=lambda u: self.take_one(owner, u),
            until=until)
        self.pos[owner] = p
        if done:
            self.splats.check_read(step, owner, p)
            self.note_read(step, owner, blocks, step - 1 - p, tested, largest(self.rel_seen, blocks))
        return done

    def own_admitted(self, step: int, own: int, until: int) -> Optional[int]:
        """The version of its own blocks the rank renders at `step`: the first from `own` on (up to `until`) that
        the plan and the evidence admit, or step-1; None when none up to `until` is."""
        blocks = self.plan.publish_blocks(step, self.env.rank, self.env.rank)
        p, tested = self._own_walk(step, blocks, own, until)
        if p is None:
            return None
        self.note_read(step, self.env.rank, blocks, step - 1 - p, tested, largest(self.rel_hist[p], blocks))
        return p

    def _own_walk(self, step: int, blocks: List[int], own: int, until: int) -> Tuple[Optional[int], bool]:
        """`own_admitted`'s decision (the version, or None; whether an admission test ran), without its note."""
        plan, me = self.plan, self.env.rank
        p, tested = own, False
        while p < step - 1:
            if p > until:
                return None, tested
            if plan.schedule_admits(step, me, me, step - 1 - p):
                tested = True
                if self.admits(step, me, me, p, largest(self.rel_hist[p], blocks)):
                    break
            p += 1
        return (None if p > until else p), tested

    def note_read(self, step: int, owner: int, blocks: List[int], k: int, tested: bool, rel: float) -> None:
        """Count a read of `owner`'s blocks at `step`: admitted k versions behind, or refused (waited for). Kept
        until the step's record exists (the lane decides a step's reads while the previous step renders)."""
        if not blocks:
            return
        with self._notes:
            stale, refused = self._step_notes.setdefault(step, ([], [0]))
            if k:
                entry = {"owner": owner, "staleness": k, "blocks": len(blocks), "estimate": k * rel, "skipped": 0.0}
                stale.append(entry)
                self.open_stale.setdefault(owner, []).append((entry, blocks, step - 1 - k, step))
            elif tested:
                refused[0] += len(blocks)

    def attach_notes(self, step: int, record) -> None:
        """The reads of `step` noted so far, into the step's record."""
        with self._notes:
            stale, refused = self._step_notes.pop(step, ([], [0]))
        record.stale_reads.extend(stale)
        record.stale_refused += refused[0]

    def note_skipped(self, owner: int, update: int, rel: Sequence[float]) -> None:
        """Update `update` of `owner` is known now: its size is what the reads that skipped it missed."""
        with self._notes:
            kept = []
            for entry, blocks, pos, step in self.open_stale.get(owner, []):
                if pos < update <= step - 1:
                    entry["skipped"] = max(entry["skipped"], largest(rel, blocks))
                if update < step - 1:
                    kept.append((entry, blocks, pos, step))
            self.open_stale[owner] = kept

    def decide_reads(self, until: int, through: int) -> None:
        """The version every read of this rank's blocks takes (`read_version[(step, rank)]`, this rank's own
        reads too), for the steps up to `through`, as far as the evidence up to update `until` decides it: each
        reader's own decision (`take_admitted`, `own_admitted`), replayed from the same plan and the evidence this
        rank published. At the exact policies every read takes update step-1. A throughput-first step whose views
        read none of this rank's own blocks has no own read."""
        plan, me = self.plan, self.env.rank
        last = min(through, plan.stop - 1)
        for q in range(plan.num_ranks):
            step = self.next_read[q]
            while step <= last:
                reads, p = True, step - 1
                if q == me:
                    blocks = plan.publish_blocks(step, me, me)
                    reads = bool(blocks) or not plan.staleness
                    if reads and plan.staleness:
                        p = self._own_walk(step, blocks, self.sim_pos[me], until)[0]
                elif me not in plan.deps(step, q):
                    reads = False
                elif plan.staleness:
                    at = plan.publish_blocks(step, me, q)
                    p, _, done = plan.advance(step, q, me, self.sim_pos[q], until=until, admitted=lambda pos, s=step,
                                              r=q, at=at: self.admits(s, r, me, pos, largest(self.rel_hist[pos], at)))
                    p = p if done else None
                if reads and (p is None or p > until):
                    break
                if reads:
                    self.sim_pos[q] = self.read_version[(step, q)] = p
                step += 1
            self.next_read[q] = step
