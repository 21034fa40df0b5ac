"""One rank's runtime for the steps of a phase: the state the handlers of the action kinds share.

The action list is the program (`schedule.policies`); `runtime.interpreter` (or throughput-first's lane) hands each
group of consecutive actions of one kind to a handler. What travels is splats (`runtime.splat_path`: P, W's
payloads, G, U's backward); this class holds what every data path's handler needs around them:
- the phase's row layout: each block's first row at its owner (owned blocks concatenated in id order);
- W (`take_current`, and throughput-first's `take_admitted`): the owners' publications off the channels, in the
  order the lists fix on every pair of ranks (`drain` receives those that come before a reader's gradients);
- U (`apply`): selective Adam on the rows the step's contributions touch (`owner_update`), in the reference order,
  then the evidence of the update and the check that the rows that moved stay inside the bounds the phase was
  planned with (`check_envelope`: a block that left them joins every current read it is visible from);
- B: the global barrier.
Throughput-first's admission (`runtime.admission`) decides which version each read takes. No Python loop runs
over blocks in a step (only over peers and views), but for a block that left its bounds (rare).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from odin_ns.runtime.admission import ReadAdmission
from odin_ns.runtime.block_table import BlockTable
from odin_ns.runtime.owner_update import OwnerUpdate, UpdateResult
from odin_ns.runtime.row_bounds import RowBounds
from odin_ns.runtime.transport import Channels
from odin_ns.runtime.waits import WaitLog
from odin_ns.schedule.plan import PhasePlan


class OdinRuntimeError(RuntimeError):
    """A condition the runtime cannot repair without changing the result (reported, never ignored)."""


class RankRuntime(ReadAdmission):
    """The state one rank's handlers share in a phase, and its W, U and B (see the module docstring)."""

    def __init__(self, env, log: WaitLog, device: torch.device, model, num_rest: int, admit_update: float = 0.0,
                 p2p_group=None):
        self.env, self.log, self.device, self.model = env, log, device, model
        self.channels = Channels(device, log, p2p_group) if env.distributed else None
        self.owner_update = OwnerUpdate(model, num_rest, device)
        self.plan: Optional[PhasePlan] = None
        self.misses_handled = 0
        self.plan_violations = 0
        self.splats = None  # the rank's `SplatPath` (the engine sets it)
        self._init_admission(admit_update)

    # ---- phases ------------------------------------------------------------------------------------------

    def begin(self, plan: PhasePlan, table: BlockTable, envelope) -> None:
        """The phase's row layout and state; `envelope`: the block bounds the phase was planned with."""
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
        self.own_ids = torch.nonzero(self.owner == me).flatten()
        self.n_owned = int(self.count[self.own_ids].sum())
        self.row_block = torch.repeat_interleave(self.own_ids, self.count[self.own_ids], output_size=self.n_owned)
        self.own_local = torch.full((B,), -1, dtype=torch.int64)
        self.own_local[self.own_ids] = torch.arange(len(self.own_ids))
        self.ranges = {int(b): (int(s), int(s) + int(n)) for b, s, n in
                       zip(self.own_ids.tolist(), self.home_start[self.own_ids].tolist(),
                           self.count[self.own_ids].tolist())}
        self.row_block_d = self.row_block.to(self.device)
        self.own_blocks = self.own_ids.tolist()  # owned block ids in their local order
        row_local = self.own_local[self.row_block]  # an owned row's local block
        self.row_local = row_local.to(self.device)
        self.bounds = RowBounds(*(t.to(self.device) for t in envelope), plan.motion, plan.growth, self.row_block_d)
        self.extras_self: Dict[int, Dict[int, List[int]]] = {}  # step -> own view -> own blocks added after a miss
        self.extras_out: Dict[int, Dict[int, List[Tuple[int, int]]]] = {}  # step -> reader -> (view, block)
        self.moved_rows: List[torch.Tensor] = []  # rows moved outside the optimizer this step (fault injection)
        self.outside: set = set()  # owned blocks a row of which left the bounds the phase was planned with
        self._visible_in = None  # the engine's visibility test (`check_envelope` hands it)
        self.last: Optional[UpdateResult] = None
        norm_sq = torch.zeros(len(self.own_ids), dtype=torch.float64)
        if plan.staleness and self.n_owned:
            packed = torch.cat([self.model.gauss_params[n].detach().flatten(1) for n in _NAMES], dim=1)
            norm_sq.index_add_(0, row_local, packed.double().pow(2).sum(dim=1).cpu())
        self._begin_admission(plan, norm_sq.tolist())

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
                self.take_one(o, u)
                p = u
            self.pos[o] = p
        self.channels.flush()

    # ---- W: publications in ----------------------------------------------------------------------------------

    def take_current(self, step: int, owners: Sequence[int]) -> None:
        """Exact reads: the publication of update step-1 from each owner, in one batch."""
        self.take_batch([(o, step - 1) for o in owners])
        for o in owners:
            self.pos[o] = step - 1

    def take_one(self, owner: int, update: int) -> None:
        """Take `owner`'s publication of `update`: from the messages received ahead (`drain`), or the channel."""
        queued = self.queued.get(owner)
        if queued:
            u, raw = queued.pop(0)
            if u != update:
                raise OdinRuntimeError(f"publication {u} of rank {owner} arrived where {update} was expected")
            self._accept(owner, update, raw)
        else:
            self.take_batch([(owner, update)])

    def take_batch(self, pubs: Sequence[Tuple[int, int]]) -> None:
        """Receive publications (owner, update) and keep what they carry."""
        for (o, u), raw in zip(pubs, self.splats.receive(pubs) if pubs else []):
            self._accept(o, u, raw)

    def drain(self, step: int, readers: Sequence[int]) -> None:
        """Throughput-first, before receiving the readers' gradients of `step`: every publication of update step-1
        or older that a reader sent this rank comes before those gradients on the pair (the lists' order), so it is
        received now, and kept until the read that needs it advances to it (its evidence is what that read is
        decided with)."""
        plan, me = self.plan, self.env.rank
        for q in readers:
            queued = self.queued.setdefault(q, [])
            last = queued[-1][0] if queued else self.pos.get(q)
            while True:
                u = plan.next_publication(q, me, plan.start - 2 if last is None else last, step - 1)
                if u is None:
                    break
                queued.append((u, self.splats.receive([(q, u)])[0]))
                last = u

    def _accept(self, owner: int, update: int, raw: tuple) -> None:
        """A publication taken: its evidence (throughput-first) and its splats."""
        if self.plan.staleness:
            for b, value in zip(self.plan.pub_blocks(update, owner, self.env.rank), raw[1]):
                self.rel_seen[b] = value
            self.note_skipped(owner, update, self.rel_seen)
        self.splats.accept(owner, update, raw)

    # ---- U: the owners' update -----------------------------------------------------------------------------

    def apply(self, step: int, contributions: List[Tuple[torch.Tensor, torch.Tensor]], touched: torch.Tensor,
              optimizers, track: bool) -> UpdateResult:
        """Selective Adam on the rows some view saw (`touched`, ascending), from `contributions` in the reference
        order; the evidence of the update."""
        with self.log.updating():
            result = self.owner_update.run(step, contributions, touched, optimizers, track,
                                           evidence=bool(self.plan.staleness))
        self.last = result
        self.record_evidence(step, result.delta_sq, result.rows)
        return result

    def changed_rows(self) -> torch.Tensor:
        """The owned rows the last update changed, and any moved outside it since (may repeat a row)."""
        rows = self.last.rows if self.last is not None else torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat([rows] + self.moved_rows) if self.moved_rows else rows

    def mark_moved(self, row: int) -> None:
        """A row changed outside the optimizer after this step's update (fault injection): check it."""
        self.moved_rows.append(torch.tensor([row], dtype=torch.int64, device=self.device))

    def check_envelope(self, step: int, visible_in: Callable[[int, Dict[str, torch.Tensor]], int]) -> None:
        """After the update of step-1, before its version is projected: do the rows that moved lie inside the
        envelope the plan assumed for their blocks? A block a row left stays on the list of blocks outside for the
        rest of the phase (a row that is not touched again stays where it went); each is tested against every view
        of `step` that does not read it and whose read of this rank takes this version (one behind renders an
        older version); for a view that sees it the owner projects the whole block too (`extras_out`,
        `extras_self`); its evidence is inf while it is outside. Throughput-first's reads of later steps that take
        this version get the same (`extras_behind`)."""
        plan = self.plan
        if not plan.contains(step) or step == plan.start:
            self.settle_evidence()
            return
        self._visible_in = visible_in
        rows = self.changed_rows()
        new, sums = set(), None
        if rows.numel() and self.n_owned:  # the bounds check's host read brings the update's evidence back too
            params = self.model.gauss_params
            every = not self.moved_rows and rows.shape[0] == self.n_owned  # the update's rows are unique
            outside, sums = self.bounds.check(plan.index(step), None if every else rows, params["means"].detach(),
                                              params["scales"].detach(), also=self.pending_evidence())
            new = set(outside) - self.outside
        self.settle_evidence(sums)
        current = {}
        if plan.staleness and self.channels is not None:  # the reads of `step` (this rank's own too): current or
            # behind (a throughput-first step whose views read none of its own blocks has no own read to add to);
            # none takes update step-1 behind, so the evidence of blocks found outside below does not decide them
            self.decide_reads(step - 1, step)
            me = self.env.rank
            current = {q: self.read_version.get((step, q)) == step - 1 for q in plan.readers(step, me) + [me]}
        self.plan_violations += len(new)
        self.outside |= new
        if not self.outside:
            return
        for b in self.outside:  # its update's size is unknown while it is outside: no read of it is admitted behind
            self.rel_now[b] = math.inf
            self.rel_hist[step - 1][b] = math.inf
        self._outside(step, sorted(self.outside), lambda q: current.get(q, True))

    def extras_behind(self, update: int, step: int) -> None:
        """Throughput-first, after update `update`: the reads of `step` (after update+1) that take its version get
        the blocks outside their bounds that their views see, as the current reads do (`check_envelope`)."""
        if self.outside and self._visible_in is not None:
            self._outside(step, sorted(self.outside), lambda q: self.read_version.get((step, q)) == update)

    def _outside(self, step: int, outside: List[int], takes: Callable[[int], bool]) -> None:
        """The rare path: blocks outside their planned bounds, tested against the views of `step` whose read of
        this rank takes the current version (`takes(rank)`; Python per block)."""
        plan, me = self.plan, self.env.rank
        params = {n: self.model.gauss_params[n].detach() for n in _NAMES}
        for b in outside:
            s, e = self.ranges[b]
            block_rows = {n: t[s:e] for n, t in params.items()}
            for q in range(plan.num_ranks):
                for j, ids in enumerate(plan.view_reads(step, q)):
                    if b in ids or not self._visible_in(plan.rank_views(step, q)[j], block_rows):
                        continue
                    if q != me and me not in plan.deps(step, q):
                        raise OdinRuntimeError(
                            f"block {b} left the bounds its phase was planned with and is visible from view "
                            f"{plan.rank_views(step, q)[j]} of rank {q}, which does not wait for rank {me} at step "
                            f"{step}: its read set cannot be completed in time (a parameter changed outside the "
                            "optimizer?); rerun with a shorter --pipeline.phase-length")
                    if not takes(q):
                        continue
                    self.misses_handled += 1
                    if q == me:
                        self.extras_self.setdefault(step, {}).setdefault(j, []).append(b)
                    else:
                        self.extras_out.setdefault(step, {}).setdefault(q, []).append((j, b))

    def forget_step(self, step: int) -> None:
        self.extras_self.pop(step, None)
        self.extras_out.pop(step, None)
        self.moved_rows = []

    def barrier(self) -> None:
        """odin-barrier's B: every rank here before any goes on. On the default group, not the channels': the
        step's publications are still in flight (taken at the next step's W), and on NCCL a collective on their
        own communicator would queue behind those sends, which wait for receives posted after the barrier."""
        if self.channels is None:  # alone: nothing to wait for
            return
        with self.log.waiting("barrier"):
            dist.barrier()


_NAMES = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")
