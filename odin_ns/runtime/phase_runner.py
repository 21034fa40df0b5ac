"""Validate before, publish after: the per-block runtime that runs one rank's steps of a `PhasePlan`.

Per step t of the phase, on rank r (the action lists of `schedule.plan`):
- validate: from each owner r depends on at t, receive the publication of step t-1: for every block of that
  owner that r's views read at t, the rows that changed since r last received the block (row index + values),
  and of those only the parameters (means, scales, ...) some of them changed in, as a column mask in the
  header; plus any block added to a read set after a detected miss (whole, on its own tag). r waits for nothing
  else: not for owners whose blocks it does not read, not for a global barrier;
- render: the engine renders each view from `render_rows` (owned blocks and replicas, ascending block order);
- gradients: each view's rows of every block go to the block's owner, only the rows that are not all zero (a
  Gaussian the view did not touch contributes exact zeros, and adding zeros changes no float: the owner's sums
  equal those over every row), and only the columns that are not zero in every row (a column mask in the header;
  the owner puts zeros back);
- update: the owner receives the gradients of every reader of step t, sums them in the reference order (rank,
  then view), and the engine applies selective Adam to the touched rows;
- publish: the parameters of the rows the update changed are marked dirty for every other rank; each rank that
  reads a block of this owner at t+1 (throughput-first: at t+1 .. t+1+max-staleness) is sent that block's dirty
  rows (their dirty parameters) as soon as the update is done (pushed, never requested), with the relative size
  of each block's last update (the runtime's evidence for admitting delayed reads).
Throughput-first (DESIGN.md semantics 4): before a view renders, the reader takes the owner's publications in
order until the read is admitted (`admits`: the plan's overlap test and the evidence) or current; a read k
versions behind is never more than max-staleness behind nor older than the phase start. The owner replays the
same decision for each of its readers (the same plan and evidence), so it knows which reads are current (the
only ones a detected miss must complete). The engine does the same for the rank's reads of its own blocks: an
update is applied before the view renders only when the read of those blocks is not admitted.
Misses (DESIGN.md semantics 6): read sets come from the phase-start bounds inflated by a rigorous bound on the
optimizer's motion, so a miss cannot come from training. The owner still checks after every update that its
blocks lie inside the envelope the plan assumed; a block outside it is projected into every view of the next
step that does not read it, and a view that would see one of its Gaussians gets the block added to its read set
in the same publication (handled before the view renders, counted as `misses_handled`). A view whose rank does
not depend on this owner at that step would not hear of it in time: that stops the run with a message rather
than train on a result that differs from the synchronous reference.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from odin_ns.runtime.block_table import BlockTable, shard_bounds
from odin_ns.runtime.dist_env import DistEnv
from odin_ns.runtime.mailbox import TAG_EXTRA, TAG_GRAD, TAG_PUBLISH, Mailbox
from odin_ns.runtime.waits import WaitLog
from odin_ns.schedule.plan import PhasePlan


class OdinRuntimeError(RuntimeError):
    """A condition the runtime cannot repair without changing the result (reported, never ignored)."""


def _with_index(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Prefix each row with its index inside its block (exact in float32 below 2^24 rows)."""
    return torch.cat([index.to(rows.dtype)[:, None], rows], dim=1)


def _kept_rows(pieces: List[torch.Tensor], width: int, device: torch.device,
               keep: Optional[torch.Tensor] = None) -> Tuple[List[int], torch.Tensor]:
    """Of consecutive pieces (one per block, `width` columns) and a mask over their concatenated rows (default:
    the rows that are not all zero): how many rows each piece keeps, and the kept rows prefixed by their index
    inside their piece, in piece order (one pass, not one per block)."""
    if not pieces:
        return [], torch.zeros((0, width + 1), device=device)
    rows = torch.cat(pieces)
    if keep is None:
        keep = (rows != 0).any(dim=1)
    at = torch.nonzero(keep).flatten()
    sizes = torch.tensor([p.shape[0] for p in pieces], dtype=torch.int64, device=rows.device)
    ends = torch.cumsum(sizes, 0)
    piece_of = torch.searchsorted(ends, at, right=True)
    local = at - (ends - sizes)[piece_of]
    counts = torch.bincount(piece_of, minlength=len(pieces))
    return counts.tolist(), _with_index(rows[at], local)


def _columns(mask: torch.Tensor) -> torch.Tensor:
    """Column indices of a bool column mask, as int64 on the mask's device."""
    return torch.nonzero(mask).flatten()


def _and_index(used: torch.Tensor) -> torch.Tensor:
    """The column mask of rows prefixed by their index (`_with_index`): the index column always travels."""
    return torch.cat([torch.ones(1, dtype=torch.bool, device=used.device), used])


class PhaseRunner:
    """Replicas, dirty rows and the messages of one rank across the steps of its phases."""

    def __init__(self, env: DistEnv, width: int, grad_width: int, device: torch.device, log: WaitLog,
                 groups: Sequence[Tuple[int, int]] = (), admit_update: float = 0.0):
        self.env = env
        self.admit_update = admit_update  # the evidence threshold (see `admits`)
        self.width = width  # packed parameter columns
        # column ranges of the parameters (means, scales, ...): the unit in which changed values are tracked
        self.groups = list(groups) or [(0, width)]
        self.grad_width = grad_width  # gradient columns + densification statistics
        self.device = device
        self.log = log
        self.mail = Mailbox(device, log) if env.distributed else None
        self.replicas: Dict[int, torch.Tensor] = {}  # remote block -> rows [count, width]
        # dirty[q, row, group]: values of the row's parameter `group` that rank q has not been sent since they changed
        self.dirty: torch.Tensor = torch.zeros((env.world_size, 0, len(self.groups)), dtype=torch.bool)
        self.plan: PhasePlan | None = None
        self.table: BlockTable | None = None
        self.envelope: Tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.extras_in: Dict[int, Dict[int, List[int]]] = {}  # step -> view slot -> extra block ids (reader)
        self.extras_self: Dict[int, Dict[int, List[int]]] = {}  # the same, of this rank's own blocks
        self.extra_rows: Dict[Tuple[int, int], torch.Tensor] = {}  # (step, block) -> rows of a remote extra
        self.extras_out: Dict[int, Dict[int, List[Tuple[int, int]]]] = {}  # step -> rank -> (slot, block) (owner)
        self.misses_handled = 0
        self.plan_violations = 0
        # throughput-first state of the phase: per owner, the last update whose publication this rank took
        # (None: none yet); per reader, the same as the owner replays it; the owner's evidence per update
        self.pos: Dict[int, Optional[int]] = {}
        self.sim_pos: Dict[int, Optional[int]] = {}
        self.rel_now: torch.Tensor = torch.zeros(0, dtype=torch.float64)  # per block: its last update's size
        self.rel_hist: Dict[int, torch.Tensor] = {}  # update -> rel_now after it (owned blocks)
        self.rel_seen: torch.Tensor = torch.zeros(0, dtype=torch.float64)  # per remote block: as last published
        self.open_stale: Dict[int, List[Tuple[dict, List[int], int, int]]] = {}  # owner -> (entry, blocks, pos, step)
        self._structural = True
        self._notes = threading.Lock()  # reads are noted by the render thread, skipped updates by the update one

    # ---- phases ------------------------------------------------------------------------------------------

    def reset(self, n_owned: int) -> None:
        """New blocks (or values every replica must refetch): forget replicas, every owned row dirty for all."""
        self.replicas.clear()
        self.dirty = torch.ones((self.env.world_size, n_owned, len(self.groups)), dtype=torch.bool,
                                device=self.device)
        self._structural = True

    def mark_all_dirty(self) -> None:
        self.dirty[:] = True
        self._structural = True  # the size of the blocks' last update is unknown after a structural change

    def begin(self, plan: PhasePlan, table: BlockTable, owned_rows: torch.Tensor) -> None:
        """Start a phase: keep its plan, the bounds it assumed, and publish the blocks read at its first step."""
        self.plan, self.table = plan, table
        self.ranges = table.owned_ranges(self.env.rank)
        if self.dirty.shape[1] != owned_rows.shape[0]:
            self.reset(owned_rows.shape[0])
        self.extras_in.clear()
        self.extras_self.clear()
        self.extra_rows.clear()
        self.extras_out.clear()
        B = plan.num_blocks
        if self._structural or self.rel_now.numel() != B:
            self.rel_now = torch.full((B,), math.inf, dtype=torch.float64)
            self._structural = False
        self.rel_hist = {plan.start - 1: self.rel_now.clone()}
        # per owned block (ascending id) and per owned row its block's position; throughput-first: per owned block
        # the squared norm of its packed parameters, the evidence's denominator
        self._owned_ids = torch.tensor(sorted(self.ranges), dtype=torch.int64)
        sizes = torch.tensor([self.ranges[b][1] - self.ranges[b][0] for b in sorted(self.ranges)], dtype=torch.int64)
        self._row_block = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        self.norm_sq = torch.zeros(len(sizes), dtype=torch.float64)
        if plan.staleness:
            self.norm_sq.index_add_(0, self._row_block, owned_rows.double().pow(2).sum(dim=1).cpu())
        self.rel_seen = torch.full((B,), math.inf, dtype=torch.float64)
        # nothing of this phase taken yet: the phase-start publication (the state at the boundary) is update
        # start-1 of every owner
        self.pos = {o: None for o in range(plan.num_ranks) if o != self.env.rank}
        self.sim_pos = dict.fromkeys(self.pos)
        self.open_stale = {}
        self.publish(plan.start - 1, owned_rows)

    def finish(self) -> None:
        """End of a phase: every publication still owed to this rank taken (reads that were admitted behind
        skipped some), then every send taken (all their receives are posted by then)."""
        if self.mail is not None:
            plan, me = self.plan, self.env.rank
            for o in sorted(self.pos):
                p = self.pos[o]
                while True:
                    u = plan.next_publication(o, me, plan.start - 2 if p is None else p, plan.stop - 2)
                    if u is None:
                        break
                    self._receive(o, u, None)
                    p = u
                self.pos[o] = p
            self.mail.flush()

    # ---- validate and render -----------------------------------------------------------------------------

    def admits(self, step: int, reader: int, owner: int, pos: int, rels: torch.Tensor) -> bool:
        """May `reader`'s read of `owner`'s blocks at `step` use the version of update `pos`? The plan's overlap
        test, and the evidence: k (versions behind) times the largest relative size of the last update of the
        blocks read (`rels`, as published with update `pos`) at most `admit_update`. A block whose size is
        unknown (after a structural change) or that left its planned bounds has size inf: never admitted."""
        k = step - 1 - pos
        if not self.plan.schedule_admits(step, reader, owner, k):
            return False
        return k * (float(rels.max()) if rels.numel() else 0.0) <= self.admit_update

    def validate(self, step: int) -> None:
        """Take every publication this rank's views of `step` depend on, in order, until each owner's read is
        current or admitted behind; apply them to the replicas."""
        plan, me = self.plan, self.env.rank
        for o in plan.deps(step, me):
            blocks = plan.publish_blocks(step, o, me)
            at = torch.tensor(blocks, dtype=torch.int64)
            p, tested = plan.advance(step, me, o, self.pos[o],
                                     admitted=lambda pos: self.admits(step, me, o, pos, self.rel_seen[at]),
                                     take=lambda u: self._receive(o, u, step))
            self.pos[o] = p
            self.note_read(step, o, blocks, step - 1 - p, tested, self.rel_seen[at])

    def note_read(self, step: int, owner: int, blocks: List[int], k: int, tested: bool, rels: torch.Tensor) -> None:
        """Count a read of `owner`'s blocks at `step`: admitted k versions behind, or refused (waited for)."""
        if not blocks:
            return
        record = self.log.current
        with self._notes:
            self._note_read(record, step, owner, blocks, k, tested, rels)

    def _note_read(self, record, step, owner, blocks, k, tested, rels) -> None:
        if k:
            entry = {"owner": owner, "staleness": k, "blocks": len(blocks),
                     "estimate": k * (float(rels.max()) if rels.numel() else 0.0), "skipped": 0.0}
            record.stale_reads.append(entry)
            self.open_stale.setdefault(owner, []).append((entry, blocks, step - 1 - k, step))
        elif tested:
            record.stale_refused += len(blocks)

    def note_skipped(self, owner: int, update: int, rel: torch.Tensor) -> None:
        """Update `update` of `owner` is known now: its size is what the reads that skipped it missed."""
        with self._notes:
            self._note_skipped(owner, update, rel)

    def _note_skipped(self, owner: int, update: int, rel: torch.Tensor) -> None:
        kept = []
        for entry, blocks, pos, step in self.open_stale.get(owner, []):
            if pos < update <= step - 1:
                entry["skipped"] = max(entry["skipped"], float(rel[torch.tensor(blocks)].max()))
            if update < step - 1:
                kept.append((entry, blocks, pos, step))
        self.open_stale[owner] = kept

    def _receive(self, o: int, update: int, step: Optional[int]) -> None:
        """Take owner o's publication of `update` (its changed rows, any extra block for step update+1)."""
        plan, me, table = self.plan, self.env.rank, self.table
        blocks = plan.pub_blocks(update, o, me)
        nb = len(blocks)
        header = self.mail.recv_ints(2 * nb + 1 + self.width, o, TAG_PUBLISH, "validate")
        counts, n_extra = header[:nb], int(header[nb])
        cols = _columns(header[nb + 1:nb + 1 + self.width] > 0).to(self.device)
        rel = header[nb + 1 + self.width:].view(torch.float64)
        at = torch.tensor(blocks, dtype=torch.int64)
        self.rel_seen[at] = rel
        self.note_skipped(o, update, self.rel_seen)
        rows = self.mail.recv_rows(int(counts.sum()), 1 + cols.numel(), torch.float32, o, TAG_PUBLISH, "validate")
        start = 0
        for b, n in zip(blocks, counts.tolist()):
            piece = rows[start:start + n]
            start += n
            if b not in self.replicas:
                if n != int(table.count[b]) or cols.numel() != self.width:
                    raise OdinRuntimeError(f"block {b}: first publication holds {n} of {int(table.count[b])} "
                                           f"rows, {cols.numel()} of {self.width} columns")
                self.replicas[b] = torch.empty((n, self.width), dtype=rows.dtype, device=self.device)
            if n:
                self.replicas[b][piece[:, 0].long()[:, None], cols[None, :]] = piece[:, 1:]
        if n_extra:  # whole blocks added to a read set of step update+1 after a detected miss
            if step != update + 1:
                raise OdinRuntimeError(f"rank {o} sent extra blocks for step {update + 1} to a read it expected "
                                       "to be behind")
            extras = self.mail.recv_ints(2 * n_extra, o, TAG_EXTRA, "validate").view(-1, 2)
            extra_sizes = [int(table.count[int(b)]) for b in extras[:, 1]]
            extra = self.mail.recv_rows(sum(extra_sizes), self.width, torch.float32, o, TAG_EXTRA, "validate")
            start = 0
            for k in range(n_extra):
                j, b = int(extras[k, 0]), int(extras[k, 1])
                n = extra_sizes[k]
                self.extra_rows[(step, b)] = extra[start:start + n]
                start += n
                self.extras_in.setdefault(step, {}).setdefault(j, []).append(b)

    def view_blocks(self, step: int, slot: int, own_current: bool = True) -> List[int]:
        """Ascending block ids view `slot` of this rank renders at `step`: its read set and any extra (of its own
        blocks only when its read of them is current: a read behind renders a version that was inside)."""
        ids = list(self.plan.view_reads(step, self.env.rank)[slot])
        extra = list(self.extras_in.get(step, {}).get(slot, []))
        if own_current:
            extra += self.extras_self.get(step, {}).get(slot, [])
        return sorted(ids + extra) if extra else ids

    def render_rows(self, step: int, block_ids: Sequence[int], owned_rows: torch.Tensor) -> torch.Tensor:
        parts = []
        for b in block_ids:
            if b in self.ranges:
                s, e = self.ranges[b]
                parts.append(owned_rows[s:e])
            elif (step, b) in self.extra_rows:
                parts.append(self.extra_rows[(step, b)])
            else:
                parts.append(self.replicas[b])
        return torch.cat(parts) if parts else owned_rows[:0]

    # ---- gradients to owners -----------------------------------------------------------------------------

    def _slices(self, ids: Sequence[int]) -> Dict[int, Tuple[int, int]]:
        out, start = {}, 0
        for b in ids:
            n = int(self.table.count[b])
            out[b] = (start, start + n)
            start += n
        return out

    def _grad_entries(self, step: int, reader: int, owner: int, extras: List[Tuple[int, int]]):
        return sorted(self.plan.grad_entries(step, reader, owner) + extras)

    def send_gradients(self, step: int, contributions: Sequence[torch.Tensor], view_ids: Sequence[List[int]]) -> None:
        """Each view's non-zero gradient rows of every remote block to the block's owner (one message per owner)."""
        plan, me = self.plan, self.env.rank
        slices = [self._slices(ids) for ids in view_ids]
        extras = self.extras_in.get(step, {})
        for o in plan.deps(step, me):
            mine_extra = [(j, b) for j, bs in extras.items() for b in bs if plan.owner[b] == o]
            pieces = [contributions[j][slices[j][b][0]:slices[j][b][1]]
                      for j, b in self._grad_entries(step, me, o, mine_extra)]
            counts, kept = _kept_rows(pieces, self.grad_width, self.device)
            # columns that are zero in every row (gradients of inactive SH coefficients, ...) do not travel
            used = (kept[:, 1:] != 0).any(dim=0)
            self.mail.send_ints(torch.cat([torch.tensor(counts, dtype=torch.int64), used.cpu().to(torch.int64)]),
                                o, TAG_GRAD)
            self.mail.send_rows(kept[:, _and_index(used)], o, TAG_GRAD)

    def collect(self, step: int, contributions: Sequence[torch.Tensor],
                view_ids: Sequence[List[int]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(owned row indices, rows) of every contribution to this rank's blocks at `step`, one pair per view, in
        reference order: rank order, then view order. A Gaussian gets at most one row from each view, so the
        indices of a pair are distinct and adding a pair at once adds every row exactly as one by one would."""
        plan, me = self.plan, self.env.rank
        out: List[Tuple[torch.Tensor, torch.Tensor]] = []
        readers = set(plan.readers(step, me))
        for q in range(plan.num_ranks):
            if q == me:
                for j, ids in enumerate(view_ids):
                    idx, rows = [], []
                    for b, (s, e) in self._slices(ids).items():
                        if b in self.ranges:
                            r0 = self.ranges[b][0]
                            idx.append(torch.arange(r0, r0 + e - s, device=self.device))
                            rows.append(contributions[j][s:e])
                    if idx:
                        out.append((torch.cat(idx), torch.cat(rows)))
                continue
            if q not in readers:
                continue
            entries = self._grad_entries(step, q, me, self.extras_out.get(step, {}).get(q, []))
            header = self.mail.recv_ints(len(entries) + self.grad_width, q, TAG_GRAD, "transfer")
            counts, cols = header[:len(entries)], _columns(header[len(entries):] > 0).to(self.device)
            sent = self.mail.recv_rows(int(counts.sum()), 1 + cols.numel(), torch.float32, q, TAG_GRAD,
                                       "transfer")
            # the columns that did not travel are zeros (adding them changes no sum)
            rows = torch.zeros((sent.shape[0], self.grad_width + 1), dtype=sent.dtype, device=self.device)
            rows[:, 0] = sent[:, 0]
            rows[:, 1 + cols] = sent[:, 1:]
            # entries are in (view, block) order: the rows of one view are contiguous in the message
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]).tolist()
            first = torch.tensor([self.ranges[b][0] for _, b in entries], dtype=torch.int64)
            base = torch.repeat_interleave(first, counts).to(self.device)
            start = 0
            for k in range(len(entries)):
                if k + 1 < len(entries) and entries[k + 1][0] == entries[k][0]:
                    continue
                stop = offsets[k + 1]
                if stop > start:
                    piece = rows[start:stop]
                    out.append((piece[:, 0].long() + base[start:stop], piece[:, 1:]))
                start = stop
        return out

    # ---- after the owner's update ------------------------------------------------------------------------

    def updated(self, update: int, changed: torch.Tensor, delta_sq: Optional[torch.Tensor] = None) -> None:
        """Values update `update` changed ([rows, groups] bool) are dirty for every other rank; with the per-row
        squared change of the packed parameters, each changed block's relative update size ||delta|| / ||params||
        (its parameters at the phase start) becomes its evidence (blocks the update did not change keep theirs)."""
        if self.env.distributed:
            self.dirty |= changed[None]
            self.dirty[self.env.rank] = False
        if delta_sq is not None and self.ranges:
            d = torch.zeros(len(self._owned_ids), dtype=torch.float64).index_add_(0, self._row_block,
                                                                                 delta_sq.double().cpu())
            hit = d > 0
            self.rel_now[self._owned_ids[hit]] = torch.sqrt(d[hit] / self.norm_sq[hit].clamp_min(1e-30))
        self.rel_hist[update] = self.rel_now.clone()
        self.note_skipped(self.env.rank, update, self.rel_now)

    def reader_current(self, step: int) -> Dict[int, bool]:
        """For each other rank that reads this rank's blocks at `step`: is its read current (True) or admitted
        behind? The reader's own decision, replayed from the same plan and the evidence this rank published."""
        plan, me = self.plan, self.env.rank
        out = {}
        for q in plan.readers(step, me):
            at = torch.tensor(plan.publish_blocks(step, me, q), dtype=torch.int64)
            p, _ = plan.advance(step, q, me, self.sim_pos[q],
                                admitted=lambda pos: self.admits(step, q, me, pos, self.rel_hist[pos][at]))
            self.sim_pos[q] = p
            out[q] = p == step - 1
        return out

    def check_envelope(self, step: int, params: Dict[str, torch.Tensor],
                       visible_in: Callable[[int, torch.Tensor], bool]) -> None:
        """Before publishing for `step`: are this rank's blocks inside the envelope the plan assumed for it? A
        block outside is tested against every view of `step` that does not read it (`visible_in(view, rows)`)
        and whose read of this rank is current (a read admitted behind renders an older version, which was
        inside); its evidence becomes inf, so that no later read is admitted behind it."""
        if not self.plan.contains(step) or step == self.plan.start:
            return
        current = self.reader_current(step) if self.env.distributed else {}
        if not self.ranges:
            return
        plan, me = self.plan, self.env.rank
        lo, hi, max_scale = shard_bounds(params, self.ranges)
        i = plan.index(step)
        motion, growth = plan.motion[i], plan.growth[i]
        env_lo, env_hi, env_scale = self.envelope
        owned = sorted(self.ranges)
        at = torch.tensor(owned, dtype=torch.int64)
        inside = ((lo >= env_lo[at] - motion).all(dim=1) & (hi <= env_hi[at] + motion).all(dim=1)
                  & (max_scale.double() <= env_scale[at].double() * math.exp(growth))) | (self.table.count[at] == 0)
        for k in torch.nonzero(~inside).flatten().tolist():
            b = owned[k]
            self.plan_violations += 1
            self.rel_now[b] = math.inf
            self.rel_hist[step - 1][b] = math.inf
            s, e = self.ranges[b]
            block_rows = {n: t[s:e] for n, t in params.items()}
            for q in range(plan.num_ranks):
                for j, ids in enumerate(plan.view_reads(step, q)):
                    if b in ids or not visible_in(plan.rank_views(step, q)[j], block_rows):
                        continue
                    if q != me and me not in plan.deps(step, q):
                        raise OdinRuntimeError(
                            f"block {b} left the bounds its phase was planned with and is visible from view "
                            f"{plan.rank_views(step, q)[j]} of rank {q}, which does not wait for rank {me} at step "
                            f"{step}: its read set cannot be completed in time (a parameter changed outside the "
                            "optimizer?); rerun with a shorter --pipeline.phase-length")
                    if not current.get(q, True):
                        continue
                    self.misses_handled += 1
                    if q == me:  # used only if the rank's read of its own blocks at `step` is current
                        self.extras_self.setdefault(step, {}).setdefault(j, []).append(b)
                    else:
                        self.extras_out.setdefault(step, {}).setdefault(q, []).append((j, b))

    def publish(self, update: int, owned_rows: torch.Tensor) -> None:
        """Push update `update` (start-1: the phase-start state) to every rank that reads a block of this rank in
        its window: the dirty rows, their dirty parameters, each block's evidence, any extra block of the next
        step."""
        if not self.env.distributed or not self.plan.contains(update + 1):
            return
        plan, me = self.plan, self.env.rank
        for q in plan.pub_readers(update, me):
            blocks = plan.pub_blocks(update, me, q)
            pieces = [owned_rows[self.ranges[b][0]:self.ranges[b][1]] for b in blocks]
            dirty = torch.cat([self.dirty[q, self.ranges[b][0]:self.ranges[b][1]] for b in blocks]) if blocks \
                else torch.zeros((0, len(self.groups)), dtype=torch.bool, device=self.device)
            counts, kept = _kept_rows(pieces, self.width, self.device, dirty.any(dim=1))
            # the columns of the parameters some sent row changed in (the others equal the reader's copy)
            used = torch.zeros(self.width, dtype=torch.bool, device=self.device)
            for g, (c0, c1) in zip(dirty.any(dim=0).tolist(), self.groups):
                used[c0:c1] = g
            for b in blocks:
                s, e = self.ranges[b]
                self.dirty[q, s:e] = False
            extras = self.extras_out.get(update + 1, {}).get(q, [])
            rel = self.rel_hist[update][torch.tensor(blocks, dtype=torch.int64)].contiguous().view(torch.int64)
            self.mail.send_ints(torch.cat([torch.tensor(counts + [len(extras)], dtype=torch.int64),
                                           used.cpu().to(torch.int64), rel]), q, TAG_PUBLISH)
            self.mail.send_rows(kept[:, _and_index(used)], q, TAG_PUBLISH)
            if extras:
                self.mail.send_ints(torch.tensor([x for pair in extras for x in pair], dtype=torch.int64), q,
                                    TAG_EXTRA)
                self.mail.send_rows(torch.cat([owned_rows[self.ranges[b][0]:self.ranges[b][1]] for _, b in extras]),
                                    q, TAG_EXTRA)

    def forget_step(self, step: int) -> None:
        self.extras_in.pop(step, None)
        self.extras_self.pop(step, None)
        self.extras_out.pop(step, None)
        for key in [k for k in self.extra_rows if k[0] == step]:
            del self.extra_rows[key]

    def num_replicated(self) -> int:
        return sum(int(r.shape[0]) for r in self.replicas.values())
