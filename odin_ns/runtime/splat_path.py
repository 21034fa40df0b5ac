"""The splat data path of one rank (DESIGN.md "The data path: splats, not rows").

The actions keep their meaning and their lists; what travels is splats:
- after update u (`project_update`), the owner projects from its current parameters, in one call per step, the rows
  of its blocks for every read that takes version u: at the exact policies every view of step u+1 that reads them
  (its own views' and its readers'); at throughput-first also the reads of steps u+2 .. u+1+staleness that its
  readers admit behind at u, as the owner replays their decisions (`RankRuntime.decide_reads`: the same rule and
  the same evidence the readers decide with). It keeps the projection's graph until the step's update, or, beyond
  its budget (`runtime.projection_memory`), only the splats: U projects again with a graph, a pair at a time, from
  the rows then current if the read took the version U follows (every read at the exact policies), else from
  a copy of the rows the read took (throughput-first's reads behind), and the same values come out;
- P (owner -> reader, after update u): a header (per step of the publication's window and view of the reader: the
  splat count of the view if the read takes version u, else -1; then the view's splat count per block of the owner,
  from which the reader knows each splat's place in the whole model's block order; throughput-first adds its
  evidence, each block's last update size), then per view whose read takes version u one float32 payload of
  `WIRE` columns per splat: the splat (10 numbers) and its radius as int32 bits: 44 bytes;
- W (reader): takes the owners' publications in order, as the exact reads or the evidence decide (`RankRuntime`):
  their headers, and the views' payloads posted, each waited for just before its view renders (a view renders
  while the next view's splats travel); R renders each view from its own splats and the received ones sorted by
  key, the order one process renders in, and back-propagates to every splat;
- G (reader -> owner, per view): the gradients of the owner's splats, in the order they came: 2-D mean, conic,
  opacity and colour (the depth too when the render uses it), and, when the strategy uses absolute screen-space
  gradients (splatfacto's default), the densification statistic the reader computes from them (their scaled
  norm, one number where the two gradients would be two): 10 numbers, 40 bytes; one payload per view whose size
  both sides know, no header;
- U (owner): one backward of the splat gradients through each projection of the step (one per version read), then
  each view's contribution in the reference order (rank, then view) to the owners' update.
The reader's side (W, R's splats, G) is `runtime.splat_reader`; the projection of a step's views in one call is
`runtime.view_projection.project_views`. No rank holds another rank's rows, and no older version of its own: a
read behind was projected when its version was current. Memory is the owned rows with their optimizer state, and
the splats and kept projections in flight.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from odin_ns.render.splats import DEPTH, SPLAT_WIDTH
from odin_ns.runtime.admission import evidence_to_wire
from odin_ns.runtime.block_table import expand_ranges
from odin_ns.runtime.inbox import Inbox
from odin_ns.runtime.projection_memory import ProjectionMemory
from odin_ns.runtime.sharded import row_width
from odin_ns.runtime.splat_reader import SplatReader, splats_for
from odin_ns.runtime.view_projection import ViewProjection, backprop, project_views


class StepProjection(NamedTuple):
    """An owner's projection, at one version, of the (rank, view) pairs of one step that read its blocks at it."""

    update: int  # the version: the parameters after this update
    proj: ViewProjection
    pairs: List[Tuple[int, int]]  # (rank, slot), in the reference order
    rows: torch.Tensor  # [N] the owned row of each projected row
    row_spans: List[Tuple[int, int]]  # per pair, its projected rows
    splat_spans: List[Tuple[int, int]]  # per pair, its visible splats
    keys: torch.Tensor  # [n] each visible splat's key
    per_block: torch.Tensor  # [pairs, this rank's blocks] each pair's visible splats per block (int64)
    again: Optional[tuple]  # to project again at U (no graph kept): (per pair its camera, the SH degree, the rows'
    # parameters as the read took them, None if U's current ones)

    def span(self, pair: Tuple[int, int]) -> Tuple[int, int]:
        return self.splat_spans[self.pairs.index(pair)]


class SplatPath(SplatReader):
    """The splat messages and projections of one rank (see the module docstring). `camera(step, view)` gives a
    view's (viewmat [4, 4], K [3, 3], width, height) at a step's resolution; `owned_rows(rows)` the six parameters
    of these owned rows as they are now, gathered (a copy each: a projection's leaves); `runtime` the rank's
    `RankRuntime` (its plan, channels, evidence and decisions)."""

    def __init__(self, runtime, model, num_rest: int, camera, owned_rows, ops, memory: ProjectionMemory) -> None:
        self.runtime, self.model = runtime, model
        self.env, self.log, self.device = runtime.env, runtime.log, runtime.device
        self.ops = ops  # the runtime's operation count (odin-bench scale): an owner's projection is render work
        self.num_rest = num_rest
        # which projections keep their graph, which only their splats (U projects those again with a graph)
        self.memory = memory
        self.camera = camera
        self.owned_rows = owned_rows
        self.width = row_width(num_rest)  # a row's packed parameters
        self.absgrad = bool(model.strategy.absgrad)
        self.antialiased = model.config.rasterize_mode == "antialiased"
        # the splat columns whose gradient travels back: the depth's only when the render uses it (expected depth)
        keep = [c for c in range(SPLAT_WIDTH) if c != DEPTH or model.training_render_mode() != "RGB"]
        self.grad_columns = torch.tensor(keep, dtype=torch.int64, device=self.device)
        self.grad_width = len(keep) + (1 if self.absgrad else 0)  # a splat's gradient on the wire (with absolute
        # gradients, their statistic: `view_projection.screen_grad_norm`)
        self.steps: Dict[int, List[StepProjection]] = {}  # step -> the owner's projections read at it
        self.kept_bytes = self.kept_peak = 0  # what the kept projections hold, now and at most since read
        # step -> the owned rows some view of the step sees (a mark per row while the step's projections are made,
        # then the rows, ascending: what its update touches, known without a host read of its own)
        self.marks: Dict[int, torch.Tensor] = {}
        self.touched: Dict[int, torch.Tensor] = {}
        self.received: Dict[int, Dict[int, tuple]] = {}  # step -> owner -> (version, per view its splat count,
        # per view its splats and their pending receive, per view its splat count per block of the owner)
        self.grads_out: Dict[int, Dict[Tuple[int, int], torch.Tensor]] = {}  # step -> (owner, slot) -> [n, G]
        # receives posted before they are needed (`runtime.inbox`): ("P", update, owner) -> a publication's header,
        # ("G", step, reader, slot) -> a reader's view's splat gradients; each with its pending receive (None:
        # nothing to wait); a header's slot is -1
        self.early: Dict[Tuple[str, int, int, int], Tuple[torch.Tensor, object]] = {}
        self.layouts: Dict[Tuple[int, int], tuple] = {}  # (owner, update) -> the layout of a header posted ahead
        self.own_grads: Dict[int, Dict[int, Tuple[torch.Tensor, object]]] = {}  # step -> slot -> (grads, norm2d)
        self.inbox: Optional[Inbox] = None  # on gloo: every pair's receives posted ahead
        self.projected_upto: Optional[int] = None  # the last update whose version this rank has projected

    def begin(self, plan, table, home_start: torch.Tensor) -> None:
        """A phase's arrays: each block's first row at its owner and in the whole model's block order."""
        self.plan, self.owner, self.count = plan, table.owner, table.count
        self.home_start = home_start
        self.global_start = table.first_places()
        self.mine = self.owner == self.env.rank
        # each rank's blocks, ascending (a publication counts its splats per block of the owner: the reader's keys)
        self.blocks_of = [torch.nonzero(self.owner == o).flatten() for o in range(self.env.world_size)]
        self.slot = torch.cumsum(self.mine.to(torch.int64), 0) - 1  # a block's place among this rank's blocks
        self.projected_upto = None
        self.layouts.clear()
        channels = self.runtime.channels
        self.inbox = Inbox(plan, self.env.rank, channels, self._inbox_buffer, self.early) \
            if channels is not None and channels.posts_ahead else None

    # ---- the owner's projections ---------------------------------------------------------------------------

    def own_blocks(self, step: int, reader: int, slot: int) -> torch.Tensor:
        """This rank's blocks that view `slot` of `reader` renders at `step`: its read set's (from the plan's read
        mask), and any added after a detected miss (ascending; only a current read has them)."""
        me, rt = self.env.rank, self.runtime
        mask = self.plan.read_mask[step - self.plan.start, reader, slot] & self.mine
        extra = (rt.extras_self.get(step, {}).get(slot, []) if reader == me else
                 [b for j, b in rt.extras_out.get(step, {}).get(reader, []) if j == slot])
        if extra:  # rare: blocks that left their planned bounds
            mask = mask.clone()
            mask[torch.tensor(extra, dtype=torch.int64)] = True
        return torch.nonzero(mask).flatten()

    def project_update(self, update: int) -> None:
        """After update `update` (start-1: the phase start): project every read of this rank's blocks that takes
        its version, one call per step read at (render work)."""
        plan, rt = self.plan, self.runtime
        last = min(update + 1 + plan.staleness, plan.stop - 1)
        rt.decide_reads(update, last)
        for step in range(update + 2, last + 1):  # reads behind that take this version (throughput-first)
            rt.extras_behind(update, step)
        with self.log.computing(), self.ops.paused():
            for step in range(max(update + 1, plan.start), last + 1):
                pairs = [(q, j) for q in range(plan.num_ranks) if rt.read_version.get((step, q)) == update
                         for j in range(len(plan.rank_views(step, q)))]
                # every read of step update+1 takes this version or an earlier one: its touched rows are known
                final = step == update + 1
                if pairs:
                    self.steps.setdefault(step, []).append(self._project(step, update, pairs, final))
                elif final:
                    self._touched(step, int(self._mark(step).sum()))  # no projection to read it with (rare)
        self.projected_upto = update
        if self.inbox is not None:  # the readers' gradients of step update+1 now have their sizes
            self.inbox.pump()

    def _mark(self, step: int) -> torch.Tensor:
        if step not in self.marks:
            self.marks[step] = torch.zeros(int(self.count[self.mine].sum()), dtype=torch.int32, device=self.device)
        return self.marks[step]

    def _touched(self, step: int, total: int) -> None:
        self.touched[step] = torch.nonzero_static(self.marks.pop(step), size=total).flatten()

    def _project(self, step: int, update: int, pairs: List[Tuple[int, int]], final: bool) -> StepProjection:
        """Project `pairs` of `step` from the current parameters (version `update`); `final`: the step's last
        projection (its touched rows are read with its splat counts)."""
        plan = self.plan
        blocks = [self.own_blocks(step, q, j) for q, j in pairs]
        block_ids = torch.cat(blocks)
        counts = self.count[block_ids]
        per_pair = torch.stack([self.count[b].sum() for b in blocks]).tolist()  # CPU tensors
        total = sum(per_pair)
        rows = expand_ranges(self.home_start[block_ids], counts, total).to(self.device)
        keys = expand_ranges(self.global_start[block_ids], counts, total).to(self.device)
        cams = [self.camera(step, plan.rank_views(step, q)[j]) for q, j in pairs]
        taken, sh_degree = self.owned_rows(rows), self.model.sh_degree_at(step)
        keep = self.memory.keep(total)
        proj, pair_of_row = project_views(taken, self.num_rest, cams, per_pair, sh_degree, self.antialiased,
                                          keep_graph=keep)
        if keep:
            self.memory.kept_graph(total, proj.graph_bytes)
        # U follows update step-1: a read of that version projects again from the rows then current
        again = None if keep else (cams, sh_degree, None if update == step - 1 else taken)
        starts = [sum(per_pair[:k]) for k in range(len(pairs))]
        mark = self._mark(step).index_fill_(0, rows.index_select(0, proj.ids), 1)
        n_mine = len(self.blocks_of[self.env.rank])  # each pair's visible splats per block of this rank (P's header)
        slot = torch.repeat_interleave(self.slot[block_ids], counts, output_size=total).to(self.device)
        per_block = torch.bincount(pair_of_row.index_select(0, proj.ids) * n_mine + slot.index_select(0, proj.ids),
                                   minlength=len(pairs) * n_mine).view(len(pairs), n_mine)
        seen = per_block.sum(dim=1)  # each pair's visible splats
        if final:
            seen = torch.cat([seen, mark.sum().view(1)])
        seen = seen.tolist()  # the one host read
        if final:
            self._touched(step, seen.pop())
        splat_starts = [sum(seen[:k]) for k in range(len(pairs))]
        sp = StepProjection(update, proj, pairs, rows, [(a, a + n) for a, n in zip(starts, per_pair)],
                            [(a, a + n) for a, n in zip(splat_starts, seen)], keys.index_select(0, proj.ids),
                            per_block, again)
        self.kept_bytes += _kept_bytes(sp)
        self.kept_peak = max(self.kept_peak, self.kept_bytes)
        return sp

    def _backprop_again(self, sp: StepProjection, grads: torch.Tensor, norm2d) -> List[torch.Tensor]:
        """U's backward of a projection kept without its graph: each pair's rows projected again, with a graph,
        and back-propagated at once (a pair's graph at a time: a row's projection and its gradient do not depend on
        which rows share the call): per pair, the contribution a kept graph gives its rows."""
        cams, sh_degree, taken = sp.again
        parts = []
        for k, ((a, b), (sa, sb)) in enumerate(zip(sp.row_spans, sp.splat_spans)):
            if b == a:  # a view that reads none of this rank's rows
                parts.append(grads.new_zeros((0, self.width + 3)))
                continue
            # the rows as the read took them (a copy, the leaves), or as they are now
            rows = self.owned_rows(sp.rows[a:b]) if taken is None else {n: t[a:b].clone() for n, t in taken.items()}
            proj, _ = project_views(rows, self.num_rest, cams[k:k + 1], [b - a], sh_degree, self.antialiased)
            if proj.splats.shape[0] != sb - sa:
                raise RuntimeError(f"a projection of version {sp.update} made again at its update has "
                                   f"{proj.splats.shape[0]} splats where the first had {sb - sa}: its rows changed "
                                   "between the projection and the update")
            self.kept_peak = max(self.kept_peak, self.kept_bytes + proj.graph_bytes)
            parts.append(backprop(proj, grads[sa:sb], None if norm2d is None else norm2d[sa:sb]))
        return parts

    # ---- P: the splats out -----------------------------------------------------------------------------------

    def publish(self, update: int, readers: Sequence[int]) -> None:
        """P: to each reader its views' splats of every read that takes version `update`: a header, then one
        message per view (a reader renders a view once its own splats are in, while the next view's travel); every
        reader's header first, then every reader's first view, and so on."""
        me, rt, heads, views = self.env.rank, self.runtime, [], []
        n_mine = len(self.blocks_of[me])
        for q in readers:
            header, per_block, parts = [], [], []
            for step in self.plan.window(update):
                mb = len(self.plan.rank_views(step, q))
                sp = next((s for s in self.steps.get(step, []) if s.update == update and (q, 0) in s.pairs), None)
                if sp is None:
                    header += [-1] * mb
                    per_block.append(torch.zeros((mb, n_mine), dtype=torch.int64, device=self.device))
                    continue
                spans = [sp.span((q, j)) for j in range(mb)]
                header += [e - s for s, e in spans]
                first = sp.pairs.index((q, 0))  # a reader's pairs are consecutive, in view order
                per_block.append(sp.per_block[first:first + mb])
                a, b = spans[0][0], spans[-1][1]
                wire = torch.cat([sp.proj.splats.detach()[a:b],
                                  sp.proj.radii[a:b].to(torch.int32).view(torch.float32)[:, None]], dim=1)
                parts += [wire[s - a:e - a] for s, e in spans]  # each view's rows: contiguous, no copy
            head = [torch.tensor(header, dtype=torch.int64).to(self.device), torch.cat(per_block).flatten()]
            if self.plan.staleness:  # the evidence: each block's last update size, as the reader's decisions use it
                rel = rt.rel_hist[update]
                head.append(evidence_to_wire([rel[b] for b in self.plan.pub_blocks(update, me, q)]).to(self.device))
            heads.append((q, torch.cat(head)))
            views.append([(q, part) for part in parts])
            rt.channels.note("P", update, q, "send")
        sends = heads + [v[k] for k in range(max(map(len, views), default=0)) for v in views if k < len(v)]
        rt.channels.batch(sends, [], "transfer", "P")

    # ---- U: the owner's update -------------------------------------------------------------------------------

    def contributions(self, step: int, readers: Sequence[int]
                      ) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """U's input: every view's contribution to this rank's rows, in the reference order (rank, then view), as
        (owned row indices, rows); and the owned rows some view saw (ascending)."""
        me, rt = self.env.rank, self.runtime
        projections = self.steps.pop(step, [])
        self._release(projections)
        where = {pair: sp for sp in projections for pair in sp.pairs}
        order = sorted(where)  # the reference order: rank, then view
        cols = self.grad_columns.shape[0]
        payloads, fresh, posted = {}, [], []
        for q in readers:  # one message per view of the reader (its list's G actions), in slot order
            for j in range(len(self.plan.rank_views(step, q))):
                n = splats_for(projections, q, j)
                early = self.early.pop(("G", step, q, j), None)  # posted ahead (`runtime.inbox`)
                if early is not None:
                    if early[0].shape[0] != n:
                        raise RuntimeError(f"rank {q}'s gradients of step {step}, view {j}: a receive for "
                                           f"{early[0].shape[0]} splats was posted ahead where {n} were projected")
                    payloads[(q, j)] = early[0]
                    posted += [early[1]] if early[1] is not None else []
                    continue
                payloads[(q, j)] = torch.empty((n, self.grad_width), dtype=torch.float32, device=self.device)
                if self.inbox is not None:  # posted alone, then the pair moves on: the inbox may post the next
                    # view's receive ahead, which the next turn of this loop then finds in `early`
                    posted += rt.channels.batch([], [(q, payloads[(q, j)])], "transfer", wait=False)
                    self.inbox.passed(q, ("G", step, j))
                else:
                    fresh.append((q, payloads[(q, j)]))
        if payloads and rt.channels is not None:
            posted += rt.channels.batch([], fresh, "transfer", wait=False)
            rt.channels.wait_for(posted, "transfer")
            for q, j in payloads:
                rt.channels.note("G", step, q, "recv")
        # each projection's splat gradients, its pairs' parts in span order (the reference order within it): a
        # view of this rank's own gradients as they are, a remote one with the columns that did not travel zero
        parts = {id(sp): ([], []) for sp in projections}
        filled = dict.fromkeys(parts, 0)  # each projection's splats covered so far
        own = self.own_grads.pop(step, {})
        for q, j in order:
            sp = where[(q, j)]
            a, b = sp.span((q, j))
            got, norms = parts[id(sp)]
            if a != filled[id(sp)]:
                raise RuntimeError(f"step {step}: the pairs of a projection are not in its span order at {(q, j)}")
            filled[id(sp)] = b
            if q == me:
                grad, norm = own[j]
            else:
                wire = payloads[(q, j)]
                grad = wire.new_zeros((b - a, SPLAT_WIDTH))
                grad[:, self.grad_columns] = wire[:, :cols]
                norm = wire[:, cols] if self.absgrad else None
            got.append(grad)
            norms.append(norm)
        grads = {key: g[0] if len(g) == 1 else torch.cat(g) for key, (g, _) in parts.items()}
        norm2d = {key: None if not self.absgrad else n[0] if len(n) == 1 else torch.cat(n)
                  for key, (_, n) in parts.items()}
        out = {}  # pair -> (its owned rows, its contribution)
        with self.log.computing(), self.ops.paused():  # the backward of an owner's projection counts as render
            for sp in projections:
                if sp.again is None:
                    whole = backprop(sp.proj, grads[id(sp)], norm2d[id(sp)])
                    parts = [whole[a:b] for a, b in sp.row_spans]
                else:
                    parts = self._backprop_again(sp, grads[id(sp)], norm2d[id(sp)])
                out.update((pair, (sp.rows[a:b], part)) for pair, (a, b), part in zip(sp.pairs, sp.row_spans, parts))
        return [out[pair] for pair in order], self.touched.pop(step)

    def _release(self, projections: Sequence[StepProjection]) -> None:
        self.kept_bytes -= sum(_kept_bytes(sp) for sp in projections)
        self.memory.release(sum(sp.proj.graph_bytes for sp in projections))

    def take_kept_peak(self) -> int:
        """The most the kept projections held since the last call."""
        peak, self.kept_peak = self.kept_peak, self.kept_bytes
        return peak

    def forget_step(self, step: int) -> None:
        self.received.pop(step, None)
        self.grads_out.pop(step, None)
        self.own_grads.pop(step, None)
        self._release(self.steps.pop(step, []))
        self.marks.pop(step, None)
        self.touched.pop(step, None)


def _kept_bytes(sp: StepProjection) -> int:
    """What a kept projection holds until its update, in bytes: its graph (leaves and saved tensors) or the copy
    of the rows it was made from, its splats, radii and keys."""
    copy = sp.again[2] if sp.again is not None and sp.again[2] is not None else {}
    held = [sp.proj.splats, sp.proj.radii, sp.keys] + list(copy.values())
    return sp.proj.graph_bytes + sum(t.numel() * t.element_size() for t in held)
