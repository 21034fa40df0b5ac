"""One rank's runtime for the steps of a phase: the handlers of the action kinds, on row-indexed state.

The action list is the program (`schedule.policies`); `runtime.interpreter` hands each group of consecutive actions
of one kind to the handler here:
- W (`take`): receive the owners' publications the step's reads need, apply them to the arena (`replicas`);
- R: the engine renders a view from `view_rows` (owned rows, arena rows, any block added after a miss);
- G (`send_gradients`): the step's gradient rows of each owner's blocks to the owner (`messages`);
- U (`update`): receive the readers' gradients, sum them with this rank's own in the reference order and apply
  selective Adam to the touched rows (`owner_update`); check that the rows that moved stay inside the bounds
  the phase was planned with;
- P (`publish`): the rows of the update each next reader needs (whole blocks beginning a stay, else the rows the
  update touched);
- B: the global barrier.
State is indexed by rows: the owned rows are the model's parameters (owned blocks in id order), the arena holds the
replicas, and every per-step index (which rows a view renders, which rows go to which owner, which rows a
publication carries) is derived with a constant number of tensor operations from arrays planned once per phase;
no Python loop runs over blocks in a step (only over peers and views). Messages go through `transport.Channels`,
in the order the lists fix on every pair of ranks.

Throughput-first (DESIGN.md semantics 4) adds the admission of reads behind, decided from the plan and the
published evidence (each block's last update size), the owners' replay of their readers' decisions (to know which
reads are current), and the copies of the owned rows per version that the renders read while the communication
lane updates them.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from odin_ns.runtime.block_table import BlockTable
from odin_ns.runtime.messages import GROUPS, grad_header_size, group_columns, pub_header_size, with_index
from odin_ns.buffers import BufferPool, kept_rows
from odin_ns.runtime.owner_update import Contribution, OwnerUpdate, UpdateResult
from odin_ns.runtime.replicas import Arena, ArenaPlan, expand_ranges
from odin_ns.runtime.transport import Channels
from odin_ns.runtime.waits import WaitLog
from odin_ns.schedule.plan import PhasePlan


class OdinRuntimeError(RuntimeError):
    """A condition the runtime cannot repair without changing the result (reported, never ignored)."""


class RankRuntime:
    """The handlers of one rank's actions and the row-indexed state they work on (see the module docstring)."""

    def __init__(self, env, log: WaitLog, device: torch.device, model, num_rest: int,
                 groups: Sequence[Tuple[int, int]], micro_batch: int, admit_update: float = 0.0, p2p_group=None):
        self.env, self.log, self.device, self.model = env, log, device, model
        self.groups = list(groups)
        self.width = self.groups[-1][1]
        self.grad_width = self.width + 3
        # what a gradient message's header says travels: each parameter's columns, and the densification statistics
        self.grad_groups = self.groups + [(self.width, self.grad_width)]
        self.micro_batch = micro_batch
        self.admit_update = admit_update
        self.channels = Channels(device, log, p2p_group) if env.distributed else None
        self.owner_update = OwnerUpdate(model, num_rest, device)
        self.plan: Optional[PhasePlan] = None
        # throughput-first evidence: per block, the relative size of its last update (own blocks), as published
        # (remote blocks), and per update the owner's values after it; unknown (inf) after a structural change
        self.rel_now = torch.zeros(0, dtype=torch.float64)
        self._structural = True
        self.misses_handled = 0
        self.plan_violations = 0
        self._notes = threading.Lock()
        self._step_notes: Dict[int, tuple] = {}
        self._rows: Optional[torch.Tensor] = None  # view_rows' buffer (odin_ns.buffers)
        self.contribution_pool = BufferPool()  # the views' contribution rows (send_gradients hands them back)
        self.splats = None  # the splat data path (`runtime.splat_path`), where it is the one taken

    # ---- phases ------------------------------------------------------------------------------------------

    def structural_change(self) -> None:
        """Blocks or values changed outside the optimizer (refine, opacity reset): the evidence is unknown."""
        self._structural = True

    def begin(self, plan: PhasePlan, table: BlockTable, reads: torch.Tensor, envelope, rows: bool = True) -> None:
        """Plan the phase's arrays: ranges, the arena, the publication layouts; `reads[i, q, j, b]` is the plan's
        read sets as a tensor. The phase-start publication (update start-1) is the caller's first P group. With
        `rows` False (the splat data path, `runtime.splat_path`) no row travels: no arena, no layouts."""
        me, R = self.env.rank, plan.num_ranks
        self.plan, self.table = plan, table
        B = plan.num_blocks
        self.owner = table.owner.clone()
        self.count = table.count.clone()
        # each block's first row in its owner's owned rows (owned blocks concatenated in id order)
        order = torch.argsort(self.owner * (B + 1) + torch.arange(B), stable=True)
        sizes = self.count[order]
        firsts = torch.cumsum(sizes, 0) - sizes
        by_owner = torch.zeros(R + 1, dtype=torch.int64)
        by_owner.index_add_(0, self.owner[order] + 1, sizes)
        firsts = firsts - torch.cumsum(by_owner, 0)[self.owner[order]]
        self.home_start = torch.empty(B, dtype=torch.int64)
        self.home_start[order] = firsts
        mine = self.owner == me
        self.own_ids = torch.nonzero(mine).flatten()
        self.n_owned = int(self.count[self.own_ids].sum())
        self.row_block = torch.repeat_interleave(self.own_ids, self.count[self.own_ids], output_size=self.n_owned)
        self.own_local = torch.full((B,), -1, dtype=torch.int64)
        self.own_local[self.own_ids] = torch.arange(len(self.own_ids))
        self.ranges = {int(b): (int(s), int(s) + int(n)) for b, s, n in
                       zip(self.own_ids.tolist(), self.home_start[self.own_ids].tolist(),
                           self.count[self.own_ids].tolist())}
        self.row_block_d, self.own_local_d = self.row_block.to(self.device), self.own_local.to(self.device)
        self.home_start_d = self.home_start.to(self.device)
        self.reads = reads
        self.rows_path = rows
        self.arena = None if not rows else Arena(
            ArenaPlan(plan.start, plan.stop, reads[:, me].any(dim=1), self.owner, self.count, me, plan.staleness),
            self.width, self.device)
        self.envelope = tuple(t.to(self.device) for t in envelope)  # the bounds the phase was planned with
        self.extras_in: Dict[int, Dict[int, List[int]]] = {}
        self.extras_self: Dict[int, Dict[int, List[int]]] = {}
        self.extra_rows: Dict[Tuple[int, int], torch.Tensor] = {}
        self.extras_out: Dict[int, Dict[int, List[Tuple[int, int]]]] = {}
        self.moved_rows: List[torch.Tensor] = []  # rows moved outside the optimizer this step (fault injection)
        self._views: Dict[Tuple[int, int], tuple] = {}
        self._routes: Dict[int, tuple] = {}
        self._messages: Dict[Tuple[int, int], tuple] = {}
        self.last: Optional[UpdateResult] = None
        # throughput-first
        if self._structural or self.rel_now.numel() != B:
            self.rel_now = torch.full((B,), math.inf, dtype=torch.float64)
            self._structural = False
        self.rel_hist = {plan.start - 1: self.rel_now.clone()}
        self.rel_seen = torch.full((B,), math.inf, dtype=torch.float64)
        self.pos: Dict[int, Optional[int]] = {o: None for o in range(R) if o != me}
        self.queued: Dict[int, List[tuple]] = {}  # owner -> publications received ahead (throughput-first)
        # the owner's replay of the reads of its blocks (`decide_reads`): per rank the version its last decided
        # read takes and its first undecided step; per (step, rank) the version decided
        self.sim_pos: Dict[int, Optional[int]] = {q: plan.start - 1 if q == me else None for q in range(R)}
        self.next_read: Dict[int, int] = dict.fromkeys(range(R), plan.start)
        self.read_version: Dict[Tuple[int, int], int] = {}
        self.open_stale: Dict[int, list] = {}
        self.norm_sq = torch.zeros(len(self.own_ids), dtype=torch.float64)
        if plan.staleness and self.n_owned:
            packed = torch.cat([self.model.gauss_params[n].detach().flatten(1) for n in _NAMES], dim=1)
            self.norm_sq.index_add_(0, self.own_local[self.row_block], packed.double().pow(2).sum(dim=1).cpu())
        if not rows:
            return
        # every index a step needs, planned now (a step only gathers and scatters with them)
        for step in range(plan.start, plan.stop):
            reads_of_step = plan.view_reads(step, me)
            for j in range(len(reads_of_step)):
                self._view_plan(step, j)
            self._route(step, reads_of_step)
            for o in plan.deps(step, me):
                self._reader_layout(o, step - 1)
        if plan.staleness:  # reads behind take earlier publications too
            for u in range(plan.start - 1, plan.stop - 1):
                for o in range(R):
                    if o != me and me in plan.pub_readers(u, o):
                        self._reader_layout(o, u)
        for u in range(plan.start - 1, plan.stop - 1):
            for q in plan.pub_readers(u, me):
                self._owner_layout(u, q)

    def resident(self, step: int) -> Tuple[int, int]:
        """(the arena's rows: what the replicas cost this rank this phase, the rows of the remote blocks its views
        read in the publication window of `step`, what a replica store must hold at least)."""
        if self.arena is None:  # the splat data path holds no other rank's rows
            return 0, 0
        plan = self.arena.plan
        return self.arena.rows.shape[0], int(plan.window_rows[plan.index(update=step - 1)])

    def finish(self) -> None:
        """End of a phase: every publication still owed to this rank taken (reads admitted behind skipped some),
        then every send taken (all their receives are posted by then)."""
        if self.channels is None:
            return
        plan, me = self.plan, self.env.rank
        for o in sorted(self.pos):
            p = self.pos[o]
            while True:
                u = plan.next_publication(o, me, plan.start - 2 if p is None else p, plan.stop - 2)
                if u is None:
                    break
                self.take_one(o, u, None)
                p = u
            self.pos[o] = p
        self.channels.flush()

    # ---- W: publications in ----------------------------------------------------------------------------------

    def take_current(self, step: int, owners: Sequence[int]) -> None:
        """Exact reads: the publication of update step-1 from each owner, in one batch."""
        self.take_batch([(o, step - 1) for o in owners], step)
        for o in owners:
            self.pos[o] = step - 1

    def take_one(self, owner: int, update: int, step: Optional[int]) -> None:
        """Apply `owner`'s publication of `update`: from the messages received ahead (`drain`), or the channel."""
        queued = self.queued.get(owner)
        if queued:
            u, raw = queued.pop(0)
            if u != update:
                raise OdinRuntimeError(f"publication {u} of rank {owner} arrived where {update} was expected")
            self._apply(owner, update, raw, step)
        else:
            self.take_batch([(owner, update)], step)

    def take_batch(self, pubs: Sequence[Tuple[int, int]], step: Optional[int]) -> None:
        """Receive publications (owner, update) and apply them to the arena."""
        for (o, u), raw in zip(pubs, self._receive(pubs)):
            self._apply(o, u, raw, step)

    def drain(self, step: int, readers: Sequence[int]) -> None:
        """Throughput-first, before receiving the readers' gradients of `step`: every publication of update step-1
        or older that a reader sent this rank comes before those gradients on the pair (the lists' order), so it is
        received now, and kept until the read that needs it advances to it (applying it now would change what a
        render running beside the lane reads)."""
        plan, me = self.plan, self.env.rank
        for q in readers:
            queued = self.queued.setdefault(q, [])
            last = queued[-1][0] if queued else self.pos.get(q)
            while True:
                u = plan.next_publication(q, me, plan.start - 2 if last is None else last, step - 1)
                if u is None:
                    break
                queued.append((u, self._receive([(q, u)])[0]))
                last = u

    def _receive(self, pubs: Sequence[Tuple[int, int]]) -> List[tuple]:
        """Publications (owner, update) off the channels: headers in one batch, one host read, payloads in one
        batch (whole blocks added after a miss in a third, rare, round). Returns (header values, payload, extra
        block pairs, extra rows) per publication."""
        if not pubs:
            return []
        if self.splats is not None:
            return self.splats.receive(pubs)
        evidence = bool(self.plan.staleness)
        layouts = [self._reader_layout(o, u) for o, u in pubs]
        headers = [torch.empty(pub_header_size(len(lay[0]), evidence), dtype=torch.int64, device=self.device)
                   for lay in layouts]
        self.channels.batch([], [(o, h) for (o, _), h in zip(pubs, headers)], "validate")
        for o, u in pubs:
            self.channels.note("P", u, o, "recv")
        values = (torch.cat(headers) if len(headers) > 1 else headers[0]).tolist()  # the one host read
        heads, offset = [], 0
        for h in headers:
            heads.append(values[offset:offset + h.numel()])
            offset += h.numel()
        payloads, extras_ids, recvs = [], [], []
        for (o, u), head in zip(pubs, heads):
            n_rows, n_extra, used = head[0], head[1], head[2:2 + GROUPS]
            cols = sum(c1 - c0 for g, (c0, c1) in zip(used, self.groups) if g)
            payloads.append(torch.empty((n_rows, 1 + cols), dtype=torch.float32, device=self.device))
            extras_ids.append(torch.empty(2 * n_extra, dtype=torch.int64, device=self.device))
            recvs += [(o, payloads[-1]), (o, extras_ids[-1])]
        self.channels.batch([], recvs, "validate")
        out = []
        for (o, u), head, pay, ext in zip(pubs, heads, payloads, extras_ids):
            pairs, rows = [], None
            if ext.numel():  # rare: whole blocks added to a read set after a detected miss
                pairs = ext.view(-1, 2).tolist()
                rows = torch.empty((sum(int(self.count[b]) for _, b in pairs), self.width), dtype=torch.float32,
                                   device=self.device)
                self.channels.batch([], [(o, rows)], "validate")
            out.append((head, pay, pairs, rows))
        return out

    def _apply(self, owner: int, update: int, raw: tuple, step: Optional[int]) -> None:
        if self.splats is not None:
            if self.plan.staleness:
                blocks = torch.tensor(self.plan.pub_blocks(update, owner, self.env.rank), dtype=torch.int64)
                self.rel_seen[blocks] = raw[1]
                self.note_skipped(owner, update, self.rel_seen)
            self.splats.accept(owner, update, raw)
            return
        head, pay, pairs, rows = raw
        blocks, counts, total = self._reader_layout(owner, update)
        used = head[2:2 + GROUPS]
        if self.plan.staleness:
            self.rel_seen[blocks] = torch.tensor(head[2 + GROUPS:], dtype=torch.int64).view(torch.float64)
            self.note_skipped(owner, update, self.rel_seen)
        if pay.shape[0]:
            dest = self.arena.destination(update, owner, blocks, counts, total)
            self.arena.apply(dest, pay[:, 0].long(), None if all(used) else
                             group_columns(used, self.groups, self.device), pay[:, 1:])
        if pairs:
            if step != update + 1:
                raise OdinRuntimeError(f"rank {owner} sent extra blocks for step {update + 1} to a read it expected "
                                       "to be behind")
            start = 0
            for j, b in pairs:
                n = int(self.count[b])
                self.extra_rows[(step, b)] = rows[start:start + n]
                start += n
                self.extras_in.setdefault(step, {}).setdefault(j, []).append(b)

    def _reader_layout(self, owner: int, update: int):
        key = (update, -1 - owner)
        if key not in self._messages:
            blocks = torch.tensor(self.plan.pub_blocks(update, owner, self.env.rank), dtype=torch.int64)
            counts = self.count[blocks]
            self._messages[key] = (blocks, counts, int(counts.sum()))
        return self._messages[key]

    # ---- throughput-first: admission ---------------------------------------------------------------------

    def admits(self, step: int, reader: int, owner: int, pos: int, rels: torch.Tensor) -> bool:
        """May `reader`'s read of `owner`'s blocks at `step` use the version of update `pos`? The plan's overlap
        test, and the evidence: k (versions behind) times the largest relative size of the last update of the
        blocks read (`rels`, as published with update `pos`) at most `admit_update`. A block whose size is
        unknown (after a structural change) or that left its planned bounds has size inf: never admitted."""
        k = step - 1 - pos
        if not self.plan.schedule_admits(step, reader, owner, k):
            return False
        return k * (float(rels.max()) if rels.numel() else 0.0) <= self.admit_update

    def take_admitted(self, step: int, owner: int, until: int) -> bool:
        """Throughput-first read of `owner`'s blocks at `step`: take its publications up to update `until` until
        the read is current or admitted behind; whether it is decided (False: it waits for a later one)."""
        plan, me = self.plan, self.env.rank
        at = torch.tensor(plan.publish_blocks(step, owner, me), dtype=torch.int64)
        p, tested, done = plan.advance(step, me, owner, self.pos[owner],
                                       admitted=lambda pos: self.admits(step, me, owner, pos, self.rel_seen[at]),
                                       take=lambda u: self.take_one(owner, u, step), until=until)
        self.pos[owner] = p
        if done and self.splats is not None:
            self.splats.check_read(step, owner, p)
        if done:
            self.note_read(step, owner, plan.publish_blocks(step, owner, me), step - 1 - p, tested,
                           self.rel_seen[at])
        return done

    def own_admitted(self, step: int, own: int, until: int) -> Optional[int]:
        """The version of its own blocks the rank renders at `step`: the first from `own` on (up to `until`) that
        the plan and the evidence admit, or step-1; None when none up to `until` is."""
        blocks = self.plan.publish_blocks(step, self.env.rank, self.env.rank)
        p, tested = self._own_walk(step, blocks, own, until)
        if p is None:
            return None
        self.note_read(step, self.env.rank, blocks, step - 1 - p, tested, self.rel_hist[p][torch.tensor(blocks)])
        return p

    def _own_walk(self, step: int, blocks: List[int], own: int, until: int) -> Tuple[Optional[int], bool]:
        """`own_admitted`'s decision (the version, or None; whether an admission test ran), without its note."""
        plan, me = self.plan, self.env.rank
        at = torch.tensor(blocks, dtype=torch.int64)
        p, tested = own, False
        while p < step - 1:
            if p > until:
                return None, tested
            if plan.schedule_admits(step, me, me, step - 1 - p):
                tested = True
                if self.admits(step, me, me, p, self.rel_hist[p][at]):
                    break
            p += 1
        return (None if p > until else p), tested

    def note_read(self, step: int, owner: int, blocks: List[int], k: int, tested: bool, rels: torch.Tensor) -> None:
        """Count a read of `owner`'s blocks at `step`: admitted k versions behind, or refused (waited for). Kept
        until the step's record exists (the lane decides a step's reads while the previous step renders)."""
        if not blocks:
            return
        with self._notes:
            stale, refused = self._step_notes.setdefault(step, ([], [0]))
            if k:
                entry = {"owner": owner, "staleness": k, "blocks": len(blocks),
                         "estimate": k * (float(rels.max()) if rels.numel() else 0.0), "skipped": 0.0}
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

    def note_skipped(self, owner: int, update: int, rel: torch.Tensor) -> None:
        """Update `update` of `owner` is known now: its size is what the reads that skipped it missed."""
        with self._notes:
            kept = []
            for entry, blocks, pos, step in self.open_stale.get(owner, []):
                if pos < update <= step - 1:
                    entry["skipped"] = max(entry["skipped"], float(rel[torch.tensor(blocks)].max()))
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
                    at = torch.tensor(plan.publish_blocks(step, me, q), dtype=torch.int64)
                    p, _, done = plan.advance(step, q, me, self.sim_pos[q], until=until, admitted=lambda pos, s=step,
                                              r=q, at=at: self.admits(s, r, me, pos, self.rel_hist[pos][at]))
                    p = p if done else None
                if reads and (p is None or p > until):
                    break
                if reads:
                    self.sim_pos[q] = self.read_version[(step, q)] = p
                step += 1
            self.next_read[q] = step

    # ---- R: what a view renders --------------------------------------------------------------------------

    def view_rows(self, step: int, slot: int, owned: Optional[torch.Tensor], own_current: bool = True
                  ) -> Tuple[torch.Tensor, List[int]]:
        """[M, D] packed rows of view `slot` of this rank at `step`, in ascending block order, and the block ids
        (the read set plus any block added after a miss). `owned`: packed owned rows to read the rank's own blocks
        from (a throughput-first version), or None for the parameters themselves. The rows are valid until the
        next call (one buffer: the render copies them into its leaves)."""
        ids, counts, total, split = self._view_plan(step, slot)
        extra = list(self.extras_in.get(step, {}).get(slot, []))
        if own_current:
            extra += self.extras_self.get(step, {}).get(slot, [])
        if extra:
            return self._view_rows_with_extras(step, ids.tolist() + extra, owned)
        own_pos, own_index, rep_pos, rep_index = split
        self._rows = kept_rows(self._rows, total, (self.width,), torch.float32, self.device)
        rows = self._rows[:total]
        if own_pos.numel():
            source = [self.model.gauss_params[n].detach().flatten(1) for n in _NAMES] if owned is None else [owned]
            rows.index_copy_(0, own_pos, torch.cat([t.index_select(0, own_index) for t in source], dim=1)
                             if len(source) > 1 else source[0].index_select(0, own_index))
        if rep_pos.numel():
            rows.index_copy_(0, rep_pos, self.arena.rows.index_select(0, rep_index))
        return rows, self.plan.view_reads(step, self.env.rank)[slot]

    def _view_plan(self, step: int, slot: int):
        key = (step, slot)
        if key not in self._views:
            me = self.env.rank
            ids = torch.tensor(self.plan.view_reads(step, me)[slot], dtype=torch.int64)
            counts = self.count[ids]
            total = int(counts.sum())
            own = self.owner[ids] == me
            starts = torch.where(own, self.home_start[ids], self.arena.plan.slot_at[self.plan.index(step)][ids])
            if bool((starts < 0).any()):
                raise OdinRuntimeError(f"step {step}: view {slot} reads blocks the arena does not hold")
            index = expand_ranges(starts, counts, total)
            is_own = torch.repeat_interleave(own, counts, output_size=total)
            own_pos, rep_pos = torch.nonzero(is_own).flatten(), torch.nonzero(~is_own).flatten()
            split = tuple(t.to(self.device) for t in (own_pos, index[own_pos], rep_pos, index[rep_pos]))
            self._views[key] = (ids, counts, total, split)
        return self._views[key]

    def _view_rows_with_extras(self, step: int, ids: List[int], owned: Optional[torch.Tensor]):
        """The rare path of a view that renders a block added after a miss: block by block."""
        parts = []
        packed = owned if owned is not None else torch.cat(
            [self.model.gauss_params[n].detach().flatten(1) for n in _NAMES], dim=1)
        i = self.plan.index(step)
        for b in sorted(ids):
            if b in self.ranges:
                s, e = self.ranges[b]
                parts.append(packed[s:e])
            elif (step, b) in self.extra_rows:
                parts.append(self.extra_rows[(step, b)])
            else:
                s = int(self.arena.plan.slot_at[i, b])
                parts.append(self.arena.rows[s:s + int(self.count[b])])
        return (torch.cat(parts) if parts else packed[:0]), sorted(ids)

    # ---- G: gradients out --------------------------------------------------------------------------------

    def _route(self, step: int, view_ids: Sequence[List[int]]):
        """For the step's views' rows (concatenated): their owner, their row at the owner, their view, the order
        (owner, view) they travel in, and per view the positions and owned rows of this rank's own blocks."""
        key = [tuple(v) for v in view_ids]
        if step not in self._routes or self._routes[step][0] != key:
            me = self.env.rank
            owners, homes, views, mine = [], [], [], []
            offset = 0
            for j, ids in enumerate(view_ids):
                t = torch.tensor(ids, dtype=torch.int64)
                counts = self.count[t]
                total = int(counts.sum())
                owner = torch.repeat_interleave(self.owner[t], counts, output_size=total)
                home = expand_ranges(self.home_start[t], counts, total)
                at = torch.nonzero(owner == me).flatten()
                mine.append(((at + offset).to(self.device), home[at].to(self.device)))
                owners.append(owner)
                homes.append(home)
                views.append(torch.full((total,), j, dtype=torch.int64))
                offset += total
            owner, home, view = torch.cat(owners), torch.cat(homes), torch.cat(views)
            order = torch.argsort(owner * len(view_ids) + view, stable=True)  # (owner, view), rows in view order
            self._routes[step] = (key, owner.to(self.device), home.to(self.device), view.to(self.device),
                                  order.to(self.device), mine)
        return self._routes[step][1:]

    def send_gradients(self, step: int, contributions: Sequence[Contribution], view_ids: Sequence[List[int]],
                       owners: Sequence[int]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Send each owner in `owners` its rows of the step's contributions (one batch); return this rank's own
        contributions (owned row indices, rows) per view, for its update."""
        me, mb = self.env.rank, len(contributions)
        owner, home, view, order, own = self._route(step, view_ids)
        rows = torch.cat([c.rows for c in contributions]) if len(contributions) > 1 else contributions[0].rows
        mine = [(index, rows.index_select(0, at)) for at, index in own]
        if not owners:
            self._give_back(contributions)
            return mine
        R, spans = self.plan.num_ranks, self.grad_groups
        # a row travels if its view saw it (the owner's update touches only those; an unseen row's gradient is
        # zero); a parameter's columns travel if some view's gradient of it is not all zero (the same for every
        # owner: the SH coefficients above the active degree stay home until they train)
        keep = (owner != me) & (rows[:, self.width + 1] > 0)
        per_segment = torch.zeros(R * mb, dtype=torch.int64, device=self.device).index_add_(
            0, owner * mb + view, keep.to(torch.int64))
        used = (torch.stack([c.used for c in contributions]).any(dim=0) if mb > 1 else contributions[0].used
                ).to(torch.int64)
        header_values = torch.cat([per_segment.view(R, mb), used.expand(R, -1)], dim=1)  # [R, mb + groups]
        host = header_values.tolist()  # the one host read
        total = sum(sum(h[:mb]) for h in host)
        self.log.current.remote_pairs += total  # the rows of other ranks the views saw
        picked = order[torch.nonzero_static(keep[order], size=total).flatten()] if total else order[:0]
        sends, start = [], 0
        for o in range(R):
            n = sum(host[o][:mb])
            these = picked[start:start + n]
            start += n
            if o not in owners:
                continue
            cols = group_columns(host[o][mb:], spans, self.device)
            sends += [(o, header_values[o].contiguous()), (o, with_index(home[these], rows[these][:, cols]))]
            self.channels.note("G", step, o, "send")
        self.channels.batch(sends, [], "transfer", "G")
        self._give_back(contributions)
        return mine

    def _give_back(self, contributions: Sequence[Contribution]) -> None:
        """The contributions' buffers are free again: what leaves or stays was copied out of them."""
        for c in contributions:
            self.contribution_pool.give(c.rows)

    def receive_gradients(self, step: int, readers: Sequence[int]) -> Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]]:
        """Every reader's gradients of `step` on this rank's blocks: per reader, per view (owned rows, rows)."""
        if not readers:
            return {}
        mb, G, spans = self.micro_batch, self.grad_width, self.grad_groups
        headers = [torch.empty(grad_header_size(mb, len(spans)), dtype=torch.int64, device=self.device)
                   for _ in readers]
        self.channels.batch([], list(zip(readers, headers)), "transfer")
        for q in readers:
            self.channels.note("G", step, q, "recv")
        host = torch.stack(headers).tolist()  # the one host read
        payloads = []
        for k, q in enumerate(readers):
            width = sum(c1 - c0 for u, (c0, c1) in zip(host[k][mb:], spans) if u)
            payloads.append(torch.empty((sum(host[k][:mb]), 1 + width), dtype=torch.float32, device=self.device))
        self.channels.batch([], list(zip(readers, payloads)), "transfer")
        out = {}
        for k, q in enumerate(readers):
            pay = payloads[k]
            if all(host[k][mb:]):
                full = pay[:, 1:]
            else:
                full = torch.zeros((pay.shape[0], G), dtype=torch.float32, device=self.device)
                full[:, group_columns(host[k][mb:], spans, self.device)] = pay[:, 1:]  # the others are zeros
            idx = pay[:, 0].long()
            per_view, start = [], 0
            for n in host[k][:mb]:
                per_view.append((idx[start:start + n], full[start:start + n]))
                start += n
            out[q] = per_view
        return out

    # ---- U: the owners' update -----------------------------------------------------------------------------

    def update(self, step: int, mine: List[Tuple[torch.Tensor, torch.Tensor]], readers: Sequence[int],
               optimizers, track: bool) -> UpdateResult:
        """Sum every contribution of `step` in the reference order (rank, then view) and apply selective Adam."""
        if self.plan.staleness and self.channels is not None:
            self.drain(step, readers)
        received = self.receive_gradients(step, readers) if self.channels is not None else {}
        contributions = []
        for q in range(self.plan.num_ranks):
            contributions += mine if q == self.env.rank else received.get(q, [])
        return self.apply(step, contributions, optimizers, track)

    def apply(self, step: int, contributions: List[Tuple[torch.Tensor, torch.Tensor]], optimizers, track: bool
              ) -> UpdateResult:
        """Selective Adam on the rows `contributions` (in the reference order) touch; the evidence of the update."""
        with self.log.updating():
            result = self.owner_update.run(contributions, optimizers, track, evidence=bool(self.plan.staleness))
        self.last = result
        if result.delta_sq is not None and self.n_owned:
            d = torch.zeros(len(self.own_ids), dtype=torch.float64).index_add_(
                0, self.own_local[self.row_block[result.rows.cpu()]], result.delta_sq.cpu())
            hit = d > 0
            self.rel_now[self.own_ids[hit]] = torch.sqrt(d[hit] / self.norm_sq[hit].clamp_min(1e-30))
        self.rel_hist[step] = self.rel_now.clone()
        self.note_skipped(self.env.rank, step, self.rel_now)
        return result

    def changed_rows(self) -> torch.Tensor:
        """The owned rows the last update changed, and any moved outside it since (may repeat a row)."""
        rows = self.last.rows if self.last is not None else torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat([rows] + self.moved_rows) if self.moved_rows else rows

    def mark_moved(self, row: int) -> None:
        """A row changed outside the optimizer after this step's update (fault injection): publish it, check it."""
        self.moved_rows.append(torch.tensor([row], dtype=torch.int64, device=self.device))

    def check_envelope(self, step: int, visible_in: Callable[[int, Dict[str, torch.Tensor]], int]) -> None:
        """Before publishing for `step`: do the rows that moved lie inside the envelope the plan assumed for their
        blocks? A block a row left is tested against every view of `step` that does not read it and whose read of
        this rank is current (one admitted behind renders an older version, which was inside); a view that sees
        it gets the whole block in the publication (`extras_out`); its evidence becomes inf."""
        plan = self.plan
        if not plan.contains(step) or step == plan.start:
            return
        current = {}
        if plan.staleness and self.channels is not None:  # the readers' reads of `step`, current or behind
            self.decide_reads(step - 1, step)
            current = {q: self.read_version.get((step, q)) == step - 1 for q in plan.readers(step, self.env.rank)}
        rows = self.last.rows if self.last is not None else torch.zeros(0, dtype=torch.int64)
        if self.moved_rows:
            rows = torch.cat([rows] + self.moved_rows)
        if rows.numel() == 0 or not self.n_owned:
            return
        i = plan.index(step)
        motion, growth = plan.motion[i], plan.growth[i]
        env_lo, env_hi, env_scale = self.envelope
        blocks = self.row_block_d[rows]
        means = self.model.gauss_params["means"].detach()[rows]
        scale = torch.exp(self.model.gauss_params["scales"].detach()[rows]).amax(dim=1)
        inside = ((means >= env_lo[blocks] - motion).all(dim=1) & (means <= env_hi[blocks] + motion).all(dim=1)
                  & (scale.double() <= env_scale[blocks].double() * math.exp(growth)))
        if bool(inside.all()):
            return
        self._outside(step, sorted(set(blocks[~inside].tolist())), current, visible_in)

    def _outside(self, step: int, outside: List[int], current: Dict[int, bool], visible_in) -> None:
        """The rare path: blocks that left their planned bounds (Python per block)."""
        plan, me = self.plan, self.env.rank
        params = {n: self.model.gauss_params[n].detach() for n in _NAMES}
        for b in outside:
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

    # ---- P: publications out ---------------------------------------------------------------------------

    def _owner_layout(self, update: int, reader: int):
        """Publication `update` to `reader`: its blocks, which begin a stay (whole), the message offset of each of
        this rank's blocks (-1 outside it), its row count if sent whole."""
        key = (update, reader)
        if key not in self._messages:
            plan, me = self.plan, self.env.rank
            blocks = plan.pub_blocks(update, me, reader)
            before = set(plan.pub_blocks(update - 1, me, reader)) if update >= plan.start else set()
            t = torch.tensor(blocks, dtype=torch.int64)
            counts = self.count[t]
            full = torch.tensor([b not in before for b in blocks], dtype=torch.bool)
            offset = torch.full((len(self.own_ids),), -1, dtype=torch.int64)
            offset[self.own_local[t]] = torch.cumsum(counts, 0) - counts
            delta = torch.zeros(len(self.own_ids), dtype=torch.bool)
            delta[self.own_local[t[~full]]] = True
            full_rows = expand_ranges(self.home_start[t[full]], counts[full], int(counts[full].sum()))
            self._messages[key] = (t, offset.to(self.device), delta.to(self.device), full_rows.to(self.device),
                                   bool(full.any()))
        return self._messages[key]

    def publish(self, update: int, readers: Sequence[int]) -> None:
        """Push update `update` (start-1: the phase-start state, whole) to `readers`: for each, the rows of its
        blocks that begin a stay, and the rows this update touched of the others, with the parameters it may have
        changed. One host read for every reader's row count."""
        if self.channels is None or not readers:
            return
        evidence = bool(self.plan.staleness)
        params = [self.model.gauss_params[n].detach().flatten(1) for n in _NAMES]
        if update >= self.plan.start and self.last is not None:
            candidates = self.last.rows
            groups = self.last.live
            if self.moved_rows:
                candidates = torch.cat([candidates] + self.moved_rows)
                groups = torch.ones(GROUPS, dtype=torch.bool, device=self.device)
        else:
            candidates = torch.zeros(0, dtype=torch.int64, device=self.device)
            groups = torch.zeros(GROUPS, dtype=torch.bool, device=self.device)
        layouts = [self._owner_layout(update, q) for q in readers]
        local = self.own_local_d[self.row_block_d[candidates]]
        selects = [delta[local] for _, _, delta, _, _ in layouts]
        counts = torch.stack([sel.sum() for sel in selects]) if selects else torch.zeros(0, dtype=torch.int64)
        host = torch.cat([counts, groups.to(torch.int64)]).tolist()  # the one host read
        n_delta, changed_groups = host[:len(readers)], [bool(g) for g in host[len(readers):]]
        sends = []
        for q, (blocks, offset, delta, full_rows, any_full), sel, n in zip(readers, layouts, selects, n_delta):
            rows = torch.cat([full_rows, candidates[torch.nonzero_static(sel, size=n).flatten()]]) if n else full_rows
            blk = self.row_block_d[rows]
            k = offset[self.own_local_d[blk]] + (rows - self.home_start_d[blk])
            used = [True] * GROUPS if any_full else changed_groups
            # the rows it carries, only the parameters it carries (no copy of the whole shard)
            values = torch.cat([t.index_select(0, rows) for t, u in zip(params, used) if u], dim=1) if any(used) \
                else torch.zeros((rows.shape[0], 0), device=self.device)
            extras = self.extras_out.get(update + 1, {}).get(q, [])
            header = torch.tensor([rows.shape[0], len(extras)] + [int(u) for u in used], dtype=torch.int64)
            if evidence:
                header = torch.cat([header, self.rel_hist[update][blocks].contiguous().view(torch.int64)])
            sends += [(q, header.to(self.device)), (q, with_index(k, values)),
                      (q, torch.tensor([x for pair in extras for x in pair], dtype=torch.int64, device=self.device))]
            if extras:
                sends.append((q, torch.cat([torch.cat([t[self.ranges[b][0]:self.ranges[b][1]] for t in params], dim=1)
                                            for _, b in extras])))
            self.channels.note("P", update, q, "send")
        self.channels.batch(sends, [], "transfer", "P")

    def forget_step(self, step: int) -> None:
        self.extras_in.pop(step, None)
        self.extras_self.pop(step, None)
        self.extras_out.pop(step, None)
        for key in [k for k in self.extra_rows if k[0] == step]:
            del self.extra_rows[key]
        self._views = {k: v for k, v in self._views.items() if k[0] > step}
        self._routes.pop(step, None)
        self.moved_rows = []

    def barrier(self) -> None:
        if self.channels is None:  # alone: nothing to wait for
            return
        with self.log.waiting("barrier"):
            dist.barrier()


_NAMES = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")
