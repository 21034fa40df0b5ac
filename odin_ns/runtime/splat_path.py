"""The splat data path of one rank (DESIGN.md "The data path: splats, not rows"), for reads at the current version.

The actions keep their meaning and their lists; what travels is splats:
- P (owner -> reader, after update u): for each of the reader's views at step u+1, the owner projects the rows of
  its blocks the view reads (plus any block added after a detected miss) from its current parameters, keeps the
  projection's graph, and sends the visible splats: one int64 header (the splat count of each of the reader's
  views), then one float32 payload of `WIRE` columns per splat: the splat (10 numbers), its radius and its key
  (the Gaussian's position in the whole model's block order), both as int32 bits;
- W (reader, step u+1): receives them; R renders each view from its own splats and the received ones sorted by key,
  the order one process renders in, and back-propagates to every splat;
- G (reader -> owner): the gradients of the owner's splats, in the order they came: 2-D mean, conic, opacity and
  colour (the depth too when the render uses it), and the absolute screen-space gradient when the strategy uses
  it (splatfacto's default): 11 numbers, 44 bytes; one payload whose size both sides know, no header;
- U (owner): back-propagates each view's gradients through the projection it kept, in the reference order
  (rank, then view), and hands the contributions to the owners' update.
No rank holds another rank's rows: memory is the owned rows with their optimizer state, and the splats and kept
projections of one step.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from odin_ns.render.splats import DEPTH, SPLAT_WIDTH
from odin_ns.runtime.replicas import expand_ranges
from odin_ns.runtime.view_projection import Camera, ViewProjection, backprop, project_rows

WIRE = SPLAT_WIDTH + 2  # the splat, its radius, its key
RADIUS, KEY = SPLAT_WIDTH, SPLAT_WIDTH + 1


class SplatPath:
    """The splat messages and projections of one rank (see the module docstring). `camera(step, view)` gives a
    view's `Camera` at a step's resolution; `packed_rows(rows)` the owned rows' current packed parameters."""

    def __init__(self, env, log, device, model, num_rest: int, channels, camera, packed_rows, pool) -> None:
        self.env, self.log, self.device, self.model = env, log, device, model
        self.num_rest = num_rest
        self.channels = channels
        self.camera = camera
        self.packed_rows = packed_rows
        self.pool = pool
        self.absgrad = bool(model.strategy.absgrad)
        # the splat columns whose gradient travels back: the depth's only when the render uses it (expected depth)
        keep = [c for c in range(SPLAT_WIDTH) if c != DEPTH or model.training_render_mode() != "RGB"]
        self.grad_columns = torch.tensor(keep, dtype=torch.int64, device=device)
        self.antialiased = model.config.rasterize_mode == "antialiased"
        self.kept: Dict[Tuple[int, int], List[ViewProjection]] = {}  # (step, reader) -> per view, at the owner
        self.received: Dict[int, Dict[int, Tuple[List[int], torch.Tensor]]] = {}  # step -> owner -> at the reader
        self.grads_out: Dict[int, Dict[int, List[torch.Tensor]]] = {}  # step -> owner -> per view [n, G]
        self.mine: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}  # step -> own (rows, contribution)

    def begin(self, plan, table, home_start: torch.Tensor, extras_out, extras_self) -> None:
        """A phase's arrays: each block's first row at its owner and in the whole model's block order."""
        self.plan, self.owner, self.count = plan, table.owner, table.count
        self.home_start = home_start
        self.global_start = torch.cumsum(self.count, 0) - self.count
        self.extras_out, self.extras_self = extras_out, extras_self

    # ---- the owner's projections ---------------------------------------------------------------------------

    def own_blocks(self, step: int, reader: int, slot: int) -> List[int]:
        """This rank's blocks that view `slot` of `reader` renders at `step`: its read set's, and any added after
        a detected miss (ascending)."""
        me = self.env.rank
        blocks = [b for b in self.plan.view_reads(step, reader)[slot] if int(self.owner[b]) == me]
        if reader == me:
            blocks += self.extras_self.get(step, {}).get(slot, [])
        else:
            blocks += [b for j, b in self.extras_out.get(step, {}).get(reader, []) if j == slot]
        return sorted(set(blocks))

    def project(self, step: int, reader: int, slot: int) -> Tuple[ViewProjection, torch.Tensor]:
        """Project this rank's blocks for view `slot` of `reader` at `step`: the kept projection and its keys."""
        blocks = torch.tensor(self.own_blocks(step, reader, slot), dtype=torch.int64)
        counts = self.count[blocks]
        total = int(counts.sum())
        rows = expand_ranges(self.home_start[blocks], counts, total).to(self.device)
        keys = expand_ranges(self.global_start[blocks], counts, total).to(self.device)
        view = self.plan.rank_views(step, reader)[slot]
        proj = project_rows(self.packed_rows(rows), self.num_rest, self.camera(step, view),
                            self.model.sh_degree_at(step), self.antialiased)
        return proj._replace(rows=rows), keys.index_select(0, proj.ids)

    def publish(self, update: int, readers: Sequence[int]) -> None:
        """P: the splats of this rank's blocks for every view of each reader at step update+1."""
        step, sends = update + 1, []
        for q in readers:
            kept, wires = [], []
            with self.log.computing():  # an owner's projections for its readers count as render
                for j in range(len(self.plan.rank_views(step, q))):
                    proj, keys = self.project(step, q, j)
                    kept.append(proj)
                    wires.append(_wire(proj, keys))
            self.kept[(step, q)] = kept
            counts = torch.tensor([w.shape[0] for w in wires], dtype=torch.int64, device=self.device)
            sends += [(q, counts), (q, torch.cat(wires) if len(wires) > 1 else wires[0])]
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
        gradient the render fills, radii [n], the parts: per source (owner or this rank), its leaf and the order's
        inverse), and the kept projection of this rank's own blocks."""
        me = self.env.rank
        own, own_keys = self.project(step, me, slot)
        parts = [(me, own.splats.detach().requires_grad_(), own.radii, own_keys)]
        for o, (counts, payload) in sorted(self.received.get(step, {}).items()):
            start = sum(counts[:slot])
            wire = payload[start:start + counts[slot]]
            parts.append((o, wire[:, :SPLAT_WIDTH].detach().requires_grad_(),
                          wire[:, RADIUS].contiguous().view(torch.int32), wire[:, KEY].contiguous().view(torch.int32)))
        keys = torch.cat([p[3].to(torch.int64) for p in parts])
        order = torch.argsort(keys)
        splats = torch.cat([p[1] for p in parts]).index_select(0, order)
        radii = torch.cat([p[2] for p in parts]).index_select(0, order)
        return splats, radii, (parts, order), own

    def after_backward(self, step: int, slot: int, routing, own: ViewProjection, means2d) -> None:
        """After a view's backward: this rank's own contribution now; the other owners' gradients kept for G."""
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
                self.mine.setdefault(step, []).append((own.rows, backprop(own, grad, part_abs, self.pool).rows))
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
        me, cols = self.env.rank, self.grad_columns.shape[0]
        width = cols + (2 if self.absgrad else 0)
        payloads = {}
        if readers:
            for q in readers:
                n = sum(p.splats.shape[0] for p in self.kept[(step, q)])
                payloads[q] = torch.empty((n, width), dtype=torch.float32, device=self.device)
            self.channels.batch([], list(payloads.items()), "transfer")
            for q in readers:
                self.channels.note("G", step, q, "recv")
        out = []
        for q in range(self.plan.num_ranks):
            if q == me:
                out += self.mine.pop(step, [])
            elif q in payloads:
                start = 0
                with self.log.computing():  # the backward of an owner's projections counts as render
                    for proj in self.kept.pop((step, q)):
                        n = proj.splats.shape[0]
                        g = payloads[q][start:start + n]
                        start += n
                        full = g.new_zeros((n, SPLAT_WIDTH))  # the columns that did not travel are zeros
                        full[:, self.grad_columns] = g[:, :cols]
                        c = backprop(proj, full, g[:, cols:].contiguous() if self.absgrad else None, self.pool)
                        out.append((proj.rows, c.rows))
        return out

    def forget_step(self, step: int) -> None:
        self.received.pop(step, None)
        self.grads_out.pop(step, None)
        self.mine.pop(step, None)
        for key in [k for k in self.kept if k[0] <= step]:
            del self.kept[key]


def _wire(proj: ViewProjection, keys: torch.Tensor) -> torch.Tensor:
    """[n, WIRE] float32: the splats, their radii and keys as int32 bits."""
    return torch.cat([proj.splats.detach(), proj.radii.to(torch.int32).view(torch.float32)[:, None],
                      keys.to(torch.int32).view(torch.float32)[:, None]], dim=1)
