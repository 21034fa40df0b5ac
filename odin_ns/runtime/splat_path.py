"""The splat data path of one rank (DESIGN.md "The data path: splats, not rows"), for reads at the current version.

The actions keep their meaning and their lists; what travels is splats:
- P (owner -> reader, after update u): the owner projects, in one call, the rows of its blocks that every view of
  step u+1 reads (its own views' and its readers'; plus any block added after a detected miss) from its current
  parameters, keeps the projection's graph, and sends each reader the visible splats of its views: one int64
  header (the splat count of each of the reader's views), then one float32 payload of `WIRE` columns per splat:
  the splat (10 numbers), its radius and its key (the Gaussian's position in the whole model's block order), both
  as int32 bits: 48 bytes;
- W (reader, step u+1): receives them; R renders each view from its own splats and the received ones sorted by key,
  the order one process renders in, and back-propagates to every splat;
- G (reader -> owner): the gradients of the owner's splats, in the order they came: 2-D mean, conic, opacity and
  colour (the depth too when the render uses it), and the absolute screen-space gradient when the strategy uses
  it (splatfacto's default): 11 numbers, 44 bytes; one payload whose size both sides know, no header;
- U (owner): one backward of every view's splat gradients through the projection it kept, then each view's
  contribution in the reference order (rank, then view) to the owners' update.
No rank holds another rank's rows: memory is the owned rows with their optimizer state, and the splats and the
kept projection of one step.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch

from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import DEPTH, SPLAT_WIDTH
from odin_ns.runtime.replicas import expand_ranges
from odin_ns.runtime.view_projection import ViewProjection, backprop, project_rows

WIRE = SPLAT_WIDTH + 2  # the splat, its radius, its key
RADIUS, KEY = SPLAT_WIDTH, SPLAT_WIDTH + 1


class StepProjection(NamedTuple):
    """An owner's projection of one step: every (rank, view) pair that reads its blocks, in the reference order."""

    proj: ViewProjection
    pairs: List[Tuple[int, int]]  # (rank, slot)
    rows: torch.Tensor  # [N] the owned row of each projected row
    row_spans: List[Tuple[int, int]]  # per pair, its projected rows
    splat_spans: List[Tuple[int, int]]  # per pair, its visible splats
    keys: torch.Tensor  # [n] each visible splat's key


class SplatPath:
    """The splat messages and projections of one rank (see the module docstring). `camera(step, view)` gives a
    view's (viewmat [4, 4], K [3, 3], width, height) at a step's resolution; `packed_rows(rows)` the owned rows'
    current packed parameters."""

    def __init__(self, env, log, device, model, num_rest: int, channels, camera, packed_rows, ops) -> None:
        self.env, self.log, self.device, self.model = env, log, device, model
        self.ops = ops  # the runtime's operation count (odin-bench scale): an owner's projection is render work
        self.num_rest = num_rest
        self.channels = channels
        self.camera = camera
        self.packed_rows = packed_rows
        self.absgrad = bool(model.strategy.absgrad)
        self.antialiased = model.config.rasterize_mode == "antialiased"
        # the splat columns whose gradient travels back: the depth's only when the render uses it (expected depth)
        keep = [c for c in range(SPLAT_WIDTH) if c != DEPTH or model.training_render_mode() != "RGB"]
        self.grad_columns = torch.tensor(keep, dtype=torch.int64, device=device)
        self.steps: Dict[int, StepProjection] = {}  # the owner's projection of each step not yet updated
        self.received: Dict[int, Dict[int, Tuple[List[int], torch.Tensor]]] = {}  # step -> owner -> at the reader
        self.grads_out: Dict[int, Dict[int, List[torch.Tensor]]] = {}  # step -> owner -> per view [n, G]
        self.own_grads: Dict[int, List[Tuple[torch.Tensor, object]]] = {}  # step -> per own view (grads, absgrad)

    def begin(self, plan, table, home_start: torch.Tensor, extras_out, extras_self) -> None:
        """A phase's arrays: each block's first row at its owner and in the whole model's block order."""
        self.plan, self.owner, self.count = plan, table.owner, table.count
        self.home_start = home_start
        self.global_start = torch.cumsum(self.count, 0) - self.count
        self.mine = self.owner == self.env.rank
        self.extras_out, self.extras_self = extras_out, extras_self

    # ---- the owner's projections ---------------------------------------------------------------------------

    def own_blocks(self, step: int, reader: int, slot: int) -> torch.Tensor:
        """This rank's blocks that view `slot` of `reader` renders at `step`: its read set's (from the plan's read
        mask), and any added after a detected miss (ascending)."""
        me = self.env.rank
        mask = self.plan.read_mask[step - self.plan.start, reader, slot] & self.mine
        extra = (self.extras_self.get(step, {}).get(slot, []) if reader == me else
                 [b for j, b in self.extras_out.get(step, {}).get(reader, []) if j == slot])
        if extra:  # rare: blocks that left their planned bounds
            mask = mask.clone()
            mask[torch.tensor(extra, dtype=torch.int64)] = True
        return torch.nonzero(mask).flatten()

    def prepare(self, step: int) -> StepProjection:
        """Project this rank's blocks for every view of `step` that reads them, in one call (once per step: at the
        step's P, or at its first render where no other rank reads this rank's blocks)."""
        if step in self.steps:
            return self.steps[step]
        me, plan = self.env.rank, self.plan
        readers = set(plan.readers(step, me))
        pairs = [(q, j) for q in range(plan.num_ranks) if q == me or q in readers
                 for j in range(len(plan.rank_views(step, q)))]
        blocks = [self.own_blocks(step, q, j) for q, j in pairs]
        block_ids = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)
        counts = self.count[block_ids]
        per_pair = torch.stack([self.count[b].sum() for b in blocks]).tolist() if blocks else []  # CPU tensors
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
        seen = torch.bincount(pair_of_row.index_select(0, proj.ids), minlength=len(pairs)).tolist()  # host read
        splat_starts = [sum(seen[:k]) for k in range(len(pairs))]
        out = StepProjection(proj, pairs, rows, [(a, a + n) for a, n in zip(starts, per_pair)],
                             [(a, a + n) for a, n in zip(splat_starts, seen)], keys.index_select(0, proj.ids))
        self.steps[step] = out
        return out

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

    def publish(self, update: int, readers: Sequence[int]) -> None:
        """P: the splats of this rank's blocks for every view of each reader at step update+1."""
        step, sends = update + 1, []
        with self.log.computing(), self.ops.paused():  # an owner's projection for its readers counts as render
            sp = self.prepare(step)
        splats = sp.proj.splats.detach()
        radii = sp.proj.radii.to(torch.int32).view(torch.float32)[:, None]
        keys = sp.keys.to(torch.int32).view(torch.float32)[:, None]
        for q in readers:
            spans = [s for (r, _), s in zip(sp.pairs, sp.splat_spans) if r == q]
            a, b = spans[0][0], spans[-1][1]
            counts = torch.tensor([e - s for s, e in spans], dtype=torch.int64, device=self.device)
            sends += [(q, counts), (q, torch.cat([splats[a:b], radii[a:b], keys[a:b]], dim=1))]
            self.channels.note("P", update, q, "send")
        self.channels.batch(sends, [], "transfer", "P")

    # ---- the reader ----------------------------------------------------------------------------------------

    def take(self, step: int, owners: Sequence[int]) -> None:
        """W: the splats every owner in `owners` projected for this rank's views of `step` (one host read)."""
        mb = len(self.plan.rank_views(step, self.env.rank))
        headers = [torch.empty(mb, dtype=torch.int64, device=self.device) for _ in owners]
        self.channels.batch([], list(zip(owners, headers)), "validate")
        for o in owners:
            self.channels.note("P", step - 1, o, "recv")
        counts = (torch.stack(headers) if headers else torch.zeros((0, mb), dtype=torch.int64)).tolist()
        payloads = [torch.empty((sum(c), WIRE), dtype=torch.float32, device=self.device) for c in counts]
        self.channels.batch([], list(zip(owners, payloads)), "validate")
        self.received[step] = {o: (c, p) for o, c, p in zip(owners, counts, payloads)}
        self.log.current.remote_pairs += sum(sum(c) for c in counts)

    def view_splats(self, step: int, slot: int):
        """Every splat view `slot` of this rank renders at `step`, in key order: (splats [n, SPLAT_WIDTH] whose
        gradient the render fills, radii [n], the routing of their gradients: per source (owner or this rank) its
        leaf, and the sort's order)."""
        me = self.env.rank
        sp = self.prepare(step)
        a, b = sp.splat_spans[sp.pairs.index((me, slot))]
        parts = [(me, sp.proj.splats.detach()[a:b].requires_grad_(), sp.proj.radii[a:b], sp.keys[a:b])]
        for o, (counts, payload) in sorted(self.received.get(step, {}).items()):
            start = sum(counts[:slot])
            wire = payload[start:start + counts[slot]]
            parts.append((o, wire[:, :SPLAT_WIDTH].detach().requires_grad_(),
                          wire[:, RADIUS].contiguous().view(torch.int32), wire[:, KEY].contiguous().view(torch.int32)))
        keys = torch.cat([p[3].to(torch.int64) for p in parts])
        order = torch.argsort(keys)
        splats = torch.cat([p[1] for p in parts]).index_select(0, order)
        radii = torch.cat([p[2] for p in parts]).index_select(0, order)
        return splats, radii, (parts, order)

    def after_backward(self, step: int, slot: int, routing, means2d) -> None:
        """After a view's backward: its gradients of this rank's splats kept for U, the other owners' for G."""
        parts, order = routing
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
                self.own_grads.setdefault(step, []).append((grad, part_abs))
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
            self.channels.note("G", step, o, "send")
        self.channels.batch(sends, [], "transfer", "G")

    # ---- the owner's update --------------------------------------------------------------------------------

    def contributions(self, step: int, readers: Sequence[int]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """U's input: every view's contribution to this rank's rows, in the reference order (rank, then view), as
        (owned row indices, rows)."""
        me, sp = self.env.rank, self.steps.pop(step)
        cols = self.grad_columns.shape[0]
        width = cols + (2 if self.absgrad else 0)
        payloads = {}
        for q in readers:
            n = sum(e - s for (r, _), (s, e) in zip(sp.pairs, sp.splat_spans) if r == q)
            payloads[q] = torch.empty((n, width), dtype=torch.float32, device=self.device)
        if payloads:
            self.channels.batch([], list(payloads.items()), "transfer")
            for q in readers:
                self.channels.note("G", step, q, "recv")
        n_all = sp.proj.splats.shape[0]
        grads = torch.zeros((n_all, SPLAT_WIDTH), dtype=torch.float32, device=self.device)
        absgrad = torch.zeros((n_all, 2), dtype=torch.float32, device=self.device) if self.absgrad else None
        own = iter(self.own_grads.pop(step, []))
        offsets = dict.fromkeys(payloads, 0)
        for (q, _), (a, b) in zip(sp.pairs, sp.splat_spans):
            if q == me:
                g, ab = next(own)
                grads[a:b] = g
                if absgrad is not None:
                    absgrad[a:b] = ab
            else:
                k = offsets[q]
                g = payloads[q][k:k + b - a]
                offsets[q] = k + b - a
                grads[a:b, self.grad_columns] = g[:, :cols]  # the columns that did not travel stay zero
                if absgrad is not None:
                    absgrad[a:b] = g[:, cols:]
        with self.log.computing(), self.ops.paused():  # the backward of an owner's projection counts as render
            out = backprop(sp.proj, grads, absgrad).rows
        return [(sp.rows[a:b], out[a:b]) for a, b in sp.row_spans]

    def forget_step(self, step: int) -> None:
        self.received.pop(step, None)
        self.grads_out.pop(step, None)
        self.own_grads.pop(step, None)
        for key in [k for k in self.steps if k <= step]:
            del self.steps[key]
