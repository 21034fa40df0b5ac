"""The reader's side of the splat data path (a part of `runtime.splat_path.SplatPath`).

W: a publication is a header (per step of its window and view of this rank: the splat count of the view if the
read takes its version, else -1, then the view's splat count per block of the owner; throughput-first adds each
published block's evidence) and the splats it announces, one message per view; their receives are posted when the
header is read and each is waited for just before its view renders (`await_view`); they are kept for the steps
that read them, and the reader checks that the owner projected the version it decided. R: a view renders its own
splats and the received ones in key order (the order one process renders in: a received splat's key is its
block's first place in the whole model's block order plus its rank among the block's splats, which orders them as
their Gaussians' places do). G: each view's gradients of an owner's splats go back in the order they came, one
message per view and owner, as soon as the view is rendered. On gloo the receives of every pair are posted before
they are needed, in the pair's order, as their sizes become known (`runtime.inbox`). NCCL runs a rank's batches
in order on one stream, so there a view's gradients leave once the payloads posted before them are in (with two
views a rank: the second view's splats, which the owner sent right after the first's).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from odin_ns.render.splats import SPLAT_WIDTH
from odin_ns.runtime.admission import evidence_from_wire
from odin_ns.runtime.block_table import expand_ranges
from odin_ns.runtime.rank_runtime import OdinRuntimeError
from odin_ns.runtime.view_projection import screen_grad_norm

WIRE = SPLAT_WIDTH + 1  # the splat, its radius
RADIUS = SPLAT_WIDTH


def splats_for(projections: Sequence, reader: int, slot: int) -> int:
    """The splats an owner's step projections (`splat_path.StepProjection`) hold for `reader`'s view in `slot`: the
    rows of that view's gradient message to the owner."""
    return sum(e - s for sp in projections for pair, (s, e) in zip(sp.pairs, sp.splat_spans) if pair == (reader, slot))


def received_keys(global_start: torch.Tensor, blocks: torch.Tensor, per_block: Sequence[int], n: int
                  ) -> torch.Tensor:
    """Render-order keys of an owner's `n` splats for a view, sent in its blocks' order (`blocks`, ascending) and
    in row order within a block, from their count per block: the block's first place in the whole model's block
    order plus the splat's rank among the block's. Within a block they order as the Gaussians' places do, and the
    blocks' ranges do not overlap: sorted with true keys (the reader's own splats), every splat lands where one
    process renders it."""
    return expand_ranges(global_start[blocks], torch.tensor(list(per_block), dtype=torch.int64), n)


class SplatReader:
    """Receive, render from and answer the owners' splats (mixed into `SplatPath`: the state is its)."""

    def receive(self, pubs: Sequence[Tuple[int, int]]) -> List[tuple]:
        """Publications (owner, update) off the channels: headers in one batch, one host read, then every view's
        payload posted, not waited for (`await_view`). Returns (the views' counts per step of the window, evidence,
        per view whose read takes the version its payload and pending receives, the views' counts per block of the
        owner per step) per publication."""
        rt = self.runtime
        layouts = [self.layouts.pop((o, u), None) or self._header_layout(o, u) for o, u in pubs]
        early = [self.early.pop(("P", u, o, -1), None) for o, u in pubs]
        headers = [e[0] if e is not None else self._header(layout) for e, layout in zip(early, layouts)]
        fresh = [(o, h) for (o, _), h, e in zip(pubs, headers, early) if e is None]
        posted = rt.channels.batch([], fresh, "validate", wait=False)
        if self.inbox is not None:
            for (o, u), e in zip(pubs, early):
                if e is None:
                    self.inbox.passed(o, ("P", u, -1))
        rt.channels.wait_for(posted + [e[1] for e in early if e is not None and e[1] is not None], "validate")
        for o, u in pubs:
            rt.channels.note("P", u, o, "recv")
        values = (torch.cat(headers) if len(headers) > 1 else headers[0]).tolist()  # the one host read
        out, at = [], 0
        for (o, u), (shape, e, nb) in zip(pubs, layouts):
            counts, per_block = [], []
            for mb in shape:
                counts.append(values[at:at + mb])
                at += mb
            for per_view in counts:
                per_block.append([values[at + j * nb:at + (j + 1) * nb] for j in range(len(per_view))])
                at += len(per_view) * nb
                if any(c >= 0 and c != sum(b) for c, b in zip(per_view, per_block[-1])):
                    raise OdinRuntimeError(f"rank {o}'s publication of update {u}: a view's splats per block do not "
                                           f"add up to its splat count")
            evidence = evidence_from_wire(values[at:at + e])
            at += e
            parts = [torch.empty((c, WIRE), dtype=torch.float32, device=self.device)
                     for per_step in counts for c in per_step if c >= 0]  # a step's counts are all -1 or none
            out.append((counts, evidence, parts, per_block))
        # each view's payload with its pending receives (none where nothing travels): one batch per place in the
        # publications (gloo gives a work per receive; NCCL one per batch, which completes as a whole)
        for k in range(max((len(raw[2]) for raw in out), default=0)):
            batch = [(o, raw[2][k]) for (o, _), raw in zip(pubs, out) if k < len(raw[2])]
            works = rt.channels.batch([], batch, "validate", wait=False)
            sent = [t for _, t in batch if t.numel()]
            each = iter(works) if len(works) == len(sent) else None
            for raw in out:
                if k < len(raw[2]):
                    part = raw[2][k]
                    raw[2][k] = (part, [] if not part.numel() else [next(each)] if each is not None else works)
        if self.inbox is not None:  # the pair's next receives, as far as their sizes are known
            for o, u in pubs:
                self.inbox.passed(o, ("p", u, -1))
        return out

    def _header_layout(self, owner: int, update: int) -> Tuple[List[int], int, int]:
        """A publication's header: per step of its window, each of this rank's views' splat count and its counts
        per block of the owner; throughput-first's evidence, a number per block published. (This rank's views per
        step of the window, the evidence's length, the owner's block count.)"""
        me, plan = self.env.rank, self.plan
        views = [len(plan.rank_views(t, me)) for t in plan.window(update)]
        evidence = len(plan.pub_blocks(update, owner, me)) if plan.staleness else 0
        return views, evidence, len(self.blocks_of[owner])

    def _header(self, layout: Tuple[List[int], int, int]) -> torch.Tensor:
        """The receive buffer of a publication's header of `_header_layout`."""
        views, evidence, n_blocks = layout
        return torch.empty(sum(views) * (1 + n_blocks) + evidence, dtype=torch.int64, device=self.device)

    def _inbox_buffer(self, peer: int, item) -> Optional[torch.Tensor]:
        """`Inbox`'s sizes: a header's from the plan; a reader's view's gradients of a step once every projection
        of the step is made (after update step-1), as many as the splats projected for it."""
        kind, step, slot = item
        if kind == "P":  # its layout kept for the parsing (`receive`)
            layout = self.layouts[(peer, step)] = self._header_layout(peer, step)
            return self._header(layout)
        if self.projected_upto is None or self.projected_upto < step - 1:
            return None
        return torch.empty((splats_for(self.steps.get(step, []), peer, slot), self.grad_width), dtype=torch.float32,
                           device=self.device)

    def accept(self, owner: int, update: int, raw: tuple) -> None:
        """Keep a publication's splats for the steps whose read takes its version."""
        counts, _, parts, per_block = raw
        start = 0
        for step, per_view, blocks in zip(self.plan.window(update), counts, per_block):
            if per_view and per_view[0] >= 0:
                self.received.setdefault(step, {})[owner] = (update, per_view, parts[start:start + len(per_view)],
                                                              blocks)
                start += len(per_view)

    def await_view(self, step: int, slot: int) -> None:
        """Before view `slot` of `step` renders: its splats from every owner are in (their receives were posted
        when the publications' headers were read)."""
        pending = []
        for _, _, parts, _ in self.received.get(step, {}).values():
            part, works = parts[slot]
            if works:
                pending += works
                parts[slot] = (part, [])
        if pending:
            self.runtime.channels.wait_for(pending, "validate")

    def check_read(self, step: int, owner: int, version: int) -> None:
        """The reader decided that its read of `owner` at `step` takes `version`: the owner's replay agrees."""
        if owner == self.env.rank:  # its own read: projected after the update it takes
            got = next((s.update for s in self.steps.get(step, []) if (owner, 0) in s.pairs), None)
        else:
            got = self.received.get(step, {}).get(owner, (None,))[0]
        if got != version:
            raise OdinRuntimeError(f"step {step}: the read of rank {owner}'s blocks takes version {version}, but "
                                   f"rank {owner} projected it at {got}")

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
        for o, (_, _, payloads, per_block) in sorted(self.received.get(step, {}).items()):
            wire = payloads[slot][0]
            self.log.current.remote_pairs += wire.shape[0]
            keys = received_keys(self.global_start, self.blocks_of[o], per_block[slot], wire.shape[0])
            parts.append((o, wire[:, :SPLAT_WIDTH].detach().requires_grad_(),
                          wire[:, RADIUS].contiguous().view(torch.int32), keys.to(self.device)))
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
        """After a view's backward: its gradients of this rank's splats kept for U, the other owners' for G; the
        splats it received are let go (a rank holds one view's at a time, beside the next views' in flight)."""
        parts, order, has_own = routing
        norm2d = None
        if self.absgrad:  # the owners' densification statistic, from the absolute gradients (in the parts' order)
            absgrad = torch.empty_like(means2d.absgrad)
            absgrad[order] = means2d.absgrad
            _, _, W, H = self.camera(step, self.plan.rank_views(step, self.env.rank)[slot])
            norm2d = screen_grad_norm(absgrad, torch.tensor([[float(W), float(H)]], device=absgrad.device))
        start = 0
        for o, leaf, _, _ in parts:
            n = leaf.shape[0]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            part_norm = norm2d[start:start + n] if norm2d is not None else None
            start += n
            if o == self.env.rank:
                if has_own:
                    self.own_grads.setdefault(step, {})[slot] = (grad, part_norm)
            else:
                wire = grad.index_select(1, self.grad_columns)
                wire = torch.cat([wire, part_norm[:, None]], dim=1) if part_norm is not None else wire
                self.log.held.hold(wire)  # a message buffer from now on
                self.grads_out.setdefault(step, {})[(o, slot)] = wire
        for _, _, payloads, _ in self.received.get(step, {}).values():  # the view's received splats are spent
            payloads[slot] = (None, [])

    def send_gradients(self, step: int, messages: Sequence[Tuple[int, int]]) -> None:
        """G: for each (slot, owner), the gradients of the owner's splats in the view of `slot` at `step` (nothing
        travels for a view that rendered none of them)."""
        sends, out = [], self.grads_out.get(step, {})
        for slot, o in messages:
            wire = out.pop((o, slot), None)
            sends.append((o, wire if wire is not None else torch.zeros((0, self.grad_width), device=self.device)))
            self.runtime.channels.note("G", step, o, "send")
        self.runtime.channels.batch(sends, [], "transfer", "G")
