"""The splat data path of one rank (DESIGN.md "The data path: splats, not rows").

The actions keep their meaning and their lists; what travels is splats:
- after update u (`project_update`), the owner projects from its current parameters, in one call per step, the rows
  of its blocks for every read that takes version u: at the exact policies every view of step u+1 that reads them
  (its own views' and its readers'); at throughput-first also the reads of steps u+2 .. u+1+staleness that its
  readers admit behind at u, as the owner replays their decisions (`RankRuntime.decide_reads`: the same rule and
  the same evidence the readers decide with). It keeps the projection's graph until the step's update;
- P (owner -> reader, after update u): a header (per step of the publication's window and view of the reader: the
  splat count of the view if the read takes version u, else -1; throughput-first adds its evidence, each block's
  last update size), then one float32 payload of `WIRE` columns per splat: the splat (10 numbers), its radius and
  its key (the Gaussian's position in the whole model's block order), both as int32 bits: 48 bytes;
- W (reader): takes the owners' publications in order, as the exact reads or the evidence decide (`RankRuntime`),
  and keeps each step's splats; R renders each view from its own splats and the received ones sorted by key, the
  order one process renders in, and back-propagates to every splat;
- G (reader -> owner): the gradients of the owner's splats, in the order they came: 2-D mean, conic, opacity and
  colour (the depth too when the render uses it), and the absolute screen-space gradient when the strategy uses
  it (splatfacto's default): 11 numbers, 44 bytes; one payload whose size both sides know, no header;
- U (owner): one backward of the splat gradients through each projection of the step (one per version read), then
  each view's contribution in the reference order (rank, then view) to the owners' update.
No rank holds another rank's rows, and no older version of its own: a read behind was projected when its version
was current. Memory is the owned rows with their optimizer state, and the splats and kept projections in flight.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch

from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import DEPTH, SPLAT_WIDTH
from odin_ns.runtime.block_table import expand_ranges
from odin_ns.runtime.view_projection import ViewProjection, backprop, project_rows

WIRE = SPLAT_WIDTH + 2  # the splat, its radius, its key
RADIUS, KEY = SPLAT_WIDTH, SPLAT_WIDTH + 1


class StepProjection(NamedTuple):
    """An owner's projection, at one version, of the (rank, view) pairs of one step that read its blocks at it."""

    update: int  # the version: the parameters after this update
    proj: ViewProjection
    pairs: List[Tuple[int, int]]  # (rank, slot), in the reference order
    rows: torch.Tensor  # [N] the owned row of each projected row
    row_spans: List[Tuple[int, int]]  # per pair, its projected rows
    splat_spans: List[Tuple[int, int]]  # per pair, its visible splats
    keys: torch.Tensor  # [n] each visible splat's key

    def span(self, pair: Tuple[int, int]) -> Tuple[int, int]:
        return self.splat_spans[self.pairs.index(pair)]


class SplatPath:
    """The splat messages and projections of one rank (see the module docstring). `camera(step, view)` gives a
    view's (viewmat [4, 4], K [3, 3], width, height) at a step's resolution; `packed_rows(rows)` the owned rows'
    current packed parameters; `runtime` the rank's `RankRuntime` (its plan, channels, evidence and decisions)."""

    def __init__(self, runtime, model, num_rest: int, camera, packed_rows, ops) -> None:
        self.runtime, self.model = runtime, model
        self.env, self.log, self.device = runtime.env, runtime.log, runtime.device
        self.ops = ops  # the runtime's operation count (odin-bench scale): an owner's projection is render work
        self.num_rest = num_rest
        self.camera = camera
        self.packed_rows = packed_rows
        self.absgrad = bool(model.strategy.absgrad)
        self.antialiased = model.config.rasterize_mode == "antialiased"
        # the splat columns whose gradient travels back: the depth's only when the render uses it (expected depth)
        keep = [c for c in range(SPLAT_WIDTH) if c != DEPTH or model.training_render_mode() != "RGB"]
        self.grad_columns = torch.tensor(keep, dtype=torch.int64, device=self.device)
        self.grad_width = len(keep) + (2 if self.absgrad else 0)  # a splat's gradient on the wire
        self.steps: Dict[int, List[StepProjection]] = {}  # step -> the owner's projections read at it
        # step -> the owned rows some view of the step sees (a mark per row while the step's projections are made,
        # then the rows, ascending: what its update touches, known without a host read of its own)
        self.marks: Dict[int, torch.Tensor] = {}
        self.touched: Dict[int, torch.Tensor] = {}
        self.received: Dict[int, Dict[int, Tuple[int, List[int], torch.Tensor]]] = {}  # step -> owner -> (version,
        # per view splat count, splats)
        self.grads_out: Dict[int, Dict[int, List[torch.Tensor]]] = {}  # step -> owner -> per view [n, G]
        # receives posted before they are needed (exact policies): ("P", update, owner) -> a publication's header,
        # ("G", step, reader) -> a reader's splat gradients; each with its pending receive (None: nothing to wait)
        self.early: Dict[Tuple[str, int, int], Tuple[torch.Tensor, object]] = {}
        self.own_grads: Dict[int, Dict[int, Tuple[torch.Tensor, object]]] = {}  # step -> slot -> (grads, absgrad)

    def begin(self, plan, table, home_start: torch.Tensor) -> None:
        """A phase's arrays: each block's first row at its owner and in the whole model's block order."""
        self.plan, self.owner, self.count = plan, table.owner, table.count
        self.home_start = home_start
        self.global_start = torch.cumsum(self.count, 0) - self.count
        self.mine = self.owner == self.env.rank

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

    def project_update(self, update: int, timed: bool = True) -> None:
        """After update `update` (start-1: the phase start, timed as the phase's set-up): project every read of
        this rank's blocks that takes its version, one call per step read at (render work)."""
        plan, rt = self.plan, self.runtime
        last = min(update + 1 + plan.staleness, plan.stop - 1)
        rt.decide_reads(update, last)
        with self.log.computing() if timed else contextlib.nullcontext(), self.ops.paused():
            for step in range(max(update + 1, plan.start), last + 1):
                pairs = [(q, j) for q in range(plan.num_ranks) if rt.read_version.get((step, q)) == update
                         for j in range(len(plan.rank_views(step, q)))]
                # every read of step update+1 takes this version or an earlier one: its touched rows are known
                final = step == update + 1
                if pairs:
                    self.steps.setdefault(step, []).append(self._project(step, update, pairs, final))
                elif final:
                    self._touched(step, int(self._mark(step).sum()))  # no projection to read it with (rare)

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
        pair_of_row = torch.repeat_interleave(torch.arange(len(pairs)), torch.tensor(per_pair, dtype=torch.int64),
                                              output_size=total).to(self.device)
        stack = (torch.stack([c[0] for c in cams]), torch.stack([c[1] for c in cams]),
                 torch.tensor([[float(c[2]), float(c[3])] for c in cams], device=self.device))
        if self.device.type == "cpu" or len(pairs) <= 1:  # one call (one camera per row)
            row_cams = RowCameras(*(t.index_select(0, pair_of_row) for t in stack)) if len(pairs) > 1 else \
                RowCameras(*stack)
            proj = project_rows(self.packed_rows(rows), self.num_rest, row_cams, self.model.sh_degree_at(step),
                                self.antialiased)
        else:  # gsplat's kernels take one camera for all rows: one call per view
            proj = self._project_per_view(step, rows, per_pair, stack)
        starts = [sum(per_pair[:k]) for k in range(len(pairs))]
        mark = self._mark(step).index_fill_(0, rows.index_select(0, proj.ids), 1)
        seen = torch.bincount(pair_of_row.index_select(0, proj.ids), minlength=len(pairs))
        if final:
            seen = torch.cat([seen, mark.sum().view(1)])
        seen = seen.tolist()  # the one host read
        if final:
            self._touched(step, seen.pop())
        splat_starts = [sum(seen[:k]) for k in range(len(pairs))]
        return StepProjection(update, proj, pairs, rows, [(a, a + n) for a, n in zip(starts, per_pair)],
                              [(a, a + n) for a, n in zip(splat_starts, seen)], keys.index_select(0, proj.ids))

    def _project_per_view(self, step, rows, per_pair, stack) -> ViewProjection:
        """CUDA: each view's rows in its own call, the results concatenated as one projection."""
        parts, start = [], 0
        packed = self.packed_rows(rows)
        for k, n in enumerate(per_pair):
            cam = RowCameras(stack[0][k:k + 1], stack[1][k:k + 1], stack[2][k:k + 1])
            parts.append((start, project_rows(packed[start:start + n], self.num_rest, cam,
                                              self.model.sh_degree_at(step), self.antialiased)))
            start += n
        leaves = {n: torch.cat([p.leaves[n] for _, p in parts]) for n in parts[0][1].leaves}
        return ViewProjection(leaves, torch.cat([p.ids + a for a, p in parts]), torch.cat([p.radii for _, p in parts]),
                              torch.cat([p.splats for _, p in parts]), torch.cat([p.sizes.expand(p.ids.shape[0], 2)
                                                                                 for _, p in parts]))

    # ---- P: the splats out -----------------------------------------------------------------------------------

    def window(self, update: int) -> range:
        return range(max(update + 1, self.plan.start), min(update + 2 + self.plan.staleness, self.plan.stop))

    def publish(self, update: int, readers: Sequence[int]) -> None:
        """P: to each reader its views' splats of every read that takes version `update`."""
        me, rt, sends = self.env.rank, self.runtime, []
        for q in readers:
            header, parts = [], []
            for step in self.window(update):
                mb = len(self.plan.rank_views(step, q))
                sp = next((s for s in self.steps.get(step, []) if s.update == update and (q, 0) in s.pairs), None)
                if sp is None:
                    header += [-1] * mb
                    continue
                spans = [sp.span((q, j)) for j in range(mb)]
                header += [e - s for s, e in spans]
                a, b = spans[0][0], spans[-1][1]
                parts += [sp.proj.splats.detach()[a:b], sp.proj.radii[a:b].to(torch.int32).view(torch.float32)[:, None],
                          sp.keys[a:b].to(torch.int32).view(torch.float32)[:, None]]
            head = torch.tensor(header, dtype=torch.int64)
            if self.plan.staleness:  # the evidence: each block's last update size, as the reader's decisions use it
                blocks = torch.tensor(self.plan.pub_blocks(update, me, q), dtype=torch.int64)
                head = torch.cat([head, rt.rel_hist[update][blocks].contiguous().view(torch.int64)])
            payload = torch.cat([torch.cat(parts[i:i + 3], dim=1) for i in range(0, len(parts), 3)]) if parts else \
                torch.zeros((0, WIRE), device=self.device)
            sends += [(q, head.to(self.device)), (q, payload)]
            rt.channels.note("P", update, q, "send")
        rt.channels.batch(sends, [], "transfer", "P")

    # ---- W: the splats in ------------------------------------------------------------------------------------

    def receive(self, pubs: Sequence[Tuple[int, int]]) -> List[tuple]:
        """Publications (owner, update) off the channels: headers in one batch, one host read, payloads in one
        batch. Returns (the views' counts per step of the window, evidence, payload) per publication."""
        me, plan, rt = self.env.rank, self.plan, self.runtime
        shapes = [[len(plan.rank_views(t, me)) for t in self.window(u)] for _, u in pubs]
        n_ev = [len(plan.pub_blocks(u, o, me)) if plan.staleness else 0 for o, u in pubs]
        early = [self.early.pop(("P", u, o), None) for o, u in pubs]
        headers = [e[0] if e is not None else torch.empty(sum(s) + n, dtype=torch.int64, device=self.device)
                   for e, s, n in zip(early, shapes, n_ev)]
        rt.channels.batch([], [(o, h) for (o, _), h, e in zip(pubs, headers, early) if e is None], "validate")
        rt.channels.wait_for([e[1] for e in early if e is not None and e[1] is not None], "validate")
        for o, u in pubs:
            rt.channels.note("P", u, o, "recv")
        values = (torch.cat(headers) if len(headers) > 1 else headers[0]).tolist()  # the one host read
        out, at = [], 0
        for shape, e in zip(shapes, n_ev):
            counts = []
            for mb in shape:
                counts.append(values[at:at + mb])
                at += mb
            evidence = torch.tensor(values[at:at + e], dtype=torch.int64).view(torch.float64)
            at += e
            n = sum(c for per_step in counts for c in per_step if c > 0)
            out.append((counts, evidence, torch.empty((n, WIRE), dtype=torch.float32, device=self.device)))
        posted = rt.channels.batch([], [(o, raw[2]) for (o, _), raw in zip(pubs, out)], "validate", wait=False)
        if not plan.staleness:  # on every pair, the next messages' receives go after these, before they are needed
            self._post_ahead(pubs[0][1] + 1)
        rt.channels.wait_for(posted, "validate")
        return out

    def _post_ahead(self, step: int) -> None:
        """Exact policies, after posting the receives of step `step`'s publications: post the receives of the
        next messages every pair brings this rank, in the order the lists send them: the readers' splat gradients
        of `step` (U waits for them; their sizes are the splats this rank projected for them) and the headers of
        the owners' publications for step+1 (W of step+1). A sender's send then completes when it is posted."""
        me, plan, rt = self.env.rank, self.plan, self.runtime
        recvs: List[Tuple[Tuple[str, int, int], int, torch.Tensor]] = []
        where = {pair: sp for sp in self.steps.get(step, []) for pair in sp.pairs}
        for q in plan.readers(step, me):
            n = sum(e - s for pair in sorted(where) if pair[0] == q for s, e in [where[pair].span(pair)])
            recvs.append((("G", step, q), q, torch.empty((n, self.grad_width), device=self.device)))
        if plan.contains(step + 1):
            mb = len(plan.rank_views(step + 1, me))
            recvs += [(("P", step, o), o, torch.empty(mb, dtype=torch.int64, device=self.device))
                      for o in plan.deps(step + 1, me)]
        works = iter(rt.channels.batch([], [(peer, t) for _, peer, t in recvs], "validate", wait=False))
        for key, _, t in recvs:  # a receive of nothing is not posted
            self.early[key] = (t, next(works) if t.numel() else None)

    def accept(self, owner: int, update: int, raw: tuple) -> None:
        """Keep a publication's splats for the steps whose read takes its version."""
        counts, _, payload = raw
        start = 0
        for step, per_view in zip(self.window(update), counts):
            if per_view and per_view[0] >= 0:
                n = sum(per_view)
                self.received.setdefault(step, {})[owner] = (update, per_view, payload[start:start + n])
                start += n

    def check_read(self, step: int, owner: int, version: int) -> None:
        """The reader decided that its read of `owner` at `step` takes `version`: the owner's replay agrees."""
        if owner == self.env.rank:  # its own read: projected after the update it takes
            got = next(((s.update,) for s in self.steps.get(step, []) if (owner, 0) in s.pairs), None)
        else:
            got = self.received.get(step, {}).get(owner)
        if got is None or got[0] != version:
            from odin_ns.runtime.rank_runtime import OdinRuntimeError

            raise OdinRuntimeError(f"step {step}: the read of rank {owner}'s blocks takes version {version}, but "
                                   f"rank {owner} projected it at {None if got is None else got[0]}")

    # ---- R: the reader -----------------------------------------------------------------------------------

    def view_splats(self, step: int, slot: int):
        """Every splat view `slot` of this rank renders at `step`, in key order: (splats [n, SPLAT_WIDTH] whose
        gradient the render fills, radii [n], the routing of their gradients: per source (owner or this rank) its
        leaf, and the sort's order)."""
        me, parts = self.env.rank, []
        own = next((s for s in self.steps.get(step, []) if (me, slot) in s.pairs), None)
        if own is not None:  # none where a throughput-first step reads no block of its own
            a, b = own.span((me, slot))
            parts.append((me, own.proj.splats.detach()[a:b].requires_grad_(), own.proj.radii[a:b], own.keys[a:b]))
        for o, (_, counts, payload) in sorted(self.received.get(step, {}).items()):
            start = sum(counts[:slot])
            wire = payload[start:start + counts[slot]]
            self.log.current.remote_pairs += wire.shape[0]
            parts.append((o, wire[:, :SPLAT_WIDTH].detach().requires_grad_(),
                          wire[:, RADIUS].contiguous().view(torch.int32), wire[:, KEY].contiguous().view(torch.int32)))
        if not parts:
            empty = torch.zeros((0, SPLAT_WIDTH), device=self.device).requires_grad_()
            parts.append((me, empty, torch.zeros(0, dtype=torch.int32, device=self.device),
                          torch.zeros(0, dtype=torch.int32, device=self.device)))
        keys = torch.cat([p[3].to(torch.int64) for p in parts])
        order = torch.argsort(keys)
        splats = torch.cat([p[1] for p in parts]).index_select(0, order)
        radii = torch.cat([p[2] for p in parts]).index_select(0, order)
        return splats, radii, (parts, order, own is not None)

    def after_backward(self, step: int, slot: int, routing, means2d) -> None:
        """After a view's backward: its gradients of this rank's splats kept for U, the other owners' for G."""
        parts, order, has_own = routing
        absgrad = None
        if self.absgrad:
            absgrad = torch.empty_like(means2d.absgrad)
            absgrad[order] = means2d.absgrad
        start = 0
        for o, leaf, _, _ in parts:
            n = leaf.shape[0]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            part_abs = absgrad[start:start + n] if absgrad is not None else None
            start += n
            if o == self.env.rank:
                if has_own:
                    self.own_grads.setdefault(step, {})[slot] = (grad, part_abs)
            else:
                wire = grad.index_select(1, self.grad_columns)
                wire = torch.cat([wire, part_abs], dim=1) if part_abs is not None else wire
                self.grads_out.setdefault(step, {}).setdefault(o, []).append(wire)

    def send_gradients(self, step: int, owners: Sequence[int]) -> None:
        """G: each owner the gradients of its splats of every view of `step` (one payload each)."""
        sends = []
        for o in owners:
            per_view = self.grads_out.get(step, {}).get(o, [])
            sends.append((o, torch.cat(per_view) if len(per_view) > 1 else per_view[0]))
            self.runtime.channels.note("G", step, o, "send")
        self.runtime.channels.batch(sends, [], "transfer", "G")

    # ---- U: the owner's update -------------------------------------------------------------------------------

    def contributions(self, step: int, readers: Sequence[int]
                      ) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """U's input: every view's contribution to this rank's rows, in the reference order (rank, then view), as
        (owned row indices, rows); and the owned rows some view saw (ascending)."""
        me, rt = self.env.rank, self.runtime
        projections = self.steps.pop(step, [])
        where = {pair: sp for sp in projections for pair in sp.pairs}
        order = sorted(where)  # the reference order: rank, then view
        cols = self.grad_columns.shape[0]
        payloads, fresh, posted = {}, [], []
        for q in readers:
            early = self.early.pop(("G", step, q), None)  # posted before the render (`_post_ahead`)
            if early is not None:
                payloads[q] = early[0]
                posted += [early[1]] if early[1] is not None else []
                continue
            n = sum(e - s for pair in order if pair[0] == q for s, e in [where[pair].span(pair)])
            payloads[q] = torch.empty((n, self.grad_width), dtype=torch.float32, device=self.device)
            fresh.append((q, payloads[q]))
        if payloads and rt.channels is not None:
            posted += rt.channels.batch([], fresh, "transfer", wait=False)
            rt.channels.wait_for(posted, "transfer")
            for q in readers:
                rt.channels.note("G", step, q, "recv")
        grads = {id(sp): torch.zeros((sp.proj.splats.shape[0], SPLAT_WIDTH), device=self.device)
                 for sp in projections}
        absgrad = {id(sp): torch.zeros((sp.proj.splats.shape[0], 2), device=self.device) if self.absgrad else None
                   for sp in projections}
        own = self.own_grads.pop(step, {})
        offsets = dict.fromkeys(payloads, 0)
        for q, j in order:
            sp = where[(q, j)]
            a, b = sp.span((q, j))
            g, ab = grads[id(sp)], absgrad[id(sp)]
            if q == me:
                g[a:b], part_abs = own[j]
                if ab is not None:
                    ab[a:b] = part_abs
            else:
                k = offsets[q]
                wire = payloads[q][k:k + b - a]
                offsets[q] = k + b - a
                g[a:b, self.grad_columns] = wire[:, :cols]  # the columns that did not travel stay zero
                if ab is not None:
                    ab[a:b] = wire[:, cols:]
        out = {}
        with self.log.computing(), self.ops.paused():  # the backward of an owner's projection counts as render
            for sp in projections:
                out[id(sp)] = backprop(sp.proj, grads[id(sp)], absgrad[id(sp)]).rows
        result = []
        for pair in order:
            sp = where[pair]
            a, b = sp.row_spans[sp.pairs.index(pair)]
            result.append((sp.rows[a:b], out[id(sp)][a:b]))
        return result, self.touched.pop(step)

    def forget_step(self, step: int) -> None:
        self.received.pop(step, None)
        self.grads_out.pop(step, None)
        self.own_grads.pop(step, None)
        self.steps.pop(step, None)
        self.marks.pop(step, None)
        self.touched.pop(step, None)
