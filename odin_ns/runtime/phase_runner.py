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
  reads a block of this owner at t+1 is sent that block's dirty rows (their dirty parameters) as soon as the
  update is done (pushed, never requested).
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
                 groups: Sequence[Tuple[int, int]] = ()):
        self.env = env
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
        self.extra_rows: Dict[Tuple[int, int], torch.Tensor] = {}  # (step, block) -> rows of a remote extra
        self.extras_out: Dict[int, Dict[int, List[Tuple[int, int]]]] = {}  # step -> rank -> (slot, block) (owner)
        self.misses_handled = 0
        self.plan_violations = 0

    # ---- phases ------------------------------------------------------------------------------------------

    def reset(self, n_owned: int) -> None:
        """New blocks (or values every replica must refetch): forget replicas, every owned row dirty for all."""
        self.replicas.clear()
        self.dirty = torch.ones((self.env.world_size, n_owned, len(self.groups)), dtype=torch.bool,
                                device=self.device)

    def mark_all_dirty(self) -> None:
        self.dirty[:] = True

    def begin(self, plan: PhasePlan, table: BlockTable, owned_rows: torch.Tensor) -> None:
        """Start a phase: keep its plan, the bounds it assumed, and publish the blocks read at its first step."""
        self.plan, self.table = plan, table
        self.ranges = table.owned_ranges(self.env.rank)
        if self.dirty.shape[1] != owned_rows.shape[0]:
            self.reset(owned_rows.shape[0])
        self.extras_in.clear()
        self.extra_rows.clear()
        self.extras_out.clear()
        self.publish(plan.start, owned_rows)

    def finish(self) -> None:
        """End of a phase: every send taken (all its receives were posted by the plan's end)."""
        if self.mail is not None:
            self.mail.flush()

    # ---- validate and render -----------------------------------------------------------------------------

    def validate(self, step: int) -> None:
        """Receive every publication this rank's views of `step` depend on, and apply it to the replicas."""
        plan, me, table = self.plan, self.env.rank, self.table
        for o in plan.deps(step, me):
            blocks = plan.publish_blocks(step, o, me)
            header = self.mail.recv_ints(len(blocks) + 1 + self.width, o, TAG_PUBLISH, "validate")
            counts, n_extra = header[:len(blocks)], int(header[len(blocks)])
            cols = _columns(header[len(blocks) + 1:] > 0).to(self.device)
            rows = self.mail.recv_rows(int(counts.sum()), 1 + cols.numel(), torch.float32, o, TAG_PUBLISH,
                                       "validate")
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
            if n_extra:  # whole blocks added to a read set after a detected miss: every row, every column
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

    def view_blocks(self, step: int, slot: int) -> List[int]:
        """Ascending block ids view `slot` of this rank renders at `step`: its read set and any extra."""
        ids = list(self.plan.view_reads(step, self.env.rank)[slot])
        extra = self.extras_in.get(step, {}).get(slot, [])
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

    def updated(self, changed: torch.Tensor) -> None:
        """Values the update changed ([rows, groups] bool) are dirty for every other rank."""
        if self.env.distributed:
            self.dirty |= changed[None]
            self.dirty[self.env.rank] = False

    def check_envelope(self, step: int, params: Dict[str, torch.Tensor],
                       visible_in: Callable[[int, torch.Tensor], bool]) -> None:
        """Before publishing for `step`: are this rank's blocks inside the envelope the plan assumed for it? A
        block outside is tested against every view of `step` that does not read it (`visible_in(view, rows)`)."""
        if not self.plan.contains(step) or step == self.plan.start or not self.ranges:
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
                    self.misses_handled += 1
                    if q == me:
                        self.extras_in.setdefault(step, {}).setdefault(j, []).append(b)
                    else:
                        self.extras_out.setdefault(step, {}).setdefault(q, []).append((j, b))

    def publish(self, step: int, owned_rows: torch.Tensor) -> None:
        """Push to every rank that reads a block of this rank at `step` its dirty rows (and any extra block)."""
        if not self.env.distributed or not self.plan.contains(step):
            return
        plan, me = self.plan, self.env.rank
        for q in plan.readers(step, me):
            blocks = plan.publish_blocks(step, me, q)
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
            extras = self.extras_out.get(step, {}).get(q, [])
            self.mail.send_ints(torch.cat([torch.tensor(counts + [len(extras)], dtype=torch.int64),
                                           used.cpu().to(torch.int64)]), q, TAG_PUBLISH)
            self.mail.send_rows(kept[:, _and_index(used)], q, TAG_PUBLISH)
            if extras:
                self.mail.send_ints(torch.tensor([x for pair in extras for x in pair], dtype=torch.int64), q,
                                    TAG_EXTRA)
                self.mail.send_rows(torch.cat([owned_rows[self.ranges[b][0]:self.ranges[b][1]] for _, b in extras]),
                                    q, TAG_EXTRA)

    def forget_step(self, step: int) -> None:
        self.extras_in.pop(step, None)
        self.extras_out.pop(step, None)
        for key in [k for k in self.extra_rows if k[0] == step]:
            del self.extra_rows[key]

    def num_replicated(self) -> int:
        return sum(int(r.shape[0]) for r in self.replicas.values())
