"""Phase boundaries: the global synchronization points where blocks change (DESIGN.md semantics 5).

Every rank is in step here (every update of the phase applied, every message taken). Owners densify and prune
their own blocks with gsplat's strategy code, block by block (`scene.block_refine`); grown blocks are cut, empty
ones dropped, ownership rebalanced and moved blocks sent to their new owners with their Adam moments
(`runtime.rebuild`); an opacity reset clamps opacities and zeroes their moments; then the block table (owner, size,
bounds of every block) is all-gathered, from which every rank plans the next phase. `PhaseBoundary` is the part
of the engine that does this (a mixin: the state is the engine's).
"""

from __future__ import annotations

from typing import Dict

import torch

from nerfstudio.utils.rich_utils import CONSOLE

from odin_ns.runtime.block_table import BlockTable, shard_bounds
from odin_ns.runtime.rebuild import cut_rows, global_cube, morton_within, new_ownership, piece_sizes, plan_rebuild
from odin_ns.runtime.sharded import PARAM_NAMES
from odin_ns.runtime.transport import exchange
from odin_ns.scene.block_refine import refine_blocks
from odin_ns.scene.kd_split import kd_order


class PhaseBoundary:
    """Refine, rebuild, reset and the table's sync (mixed into `runtime.engine.OdinEngine`)."""

    def _sync_table(self) -> None:
        """Current sizes and bounds of this rank's blocks into the table, then the all-gather that spreads them."""
        me = self.env.rank
        ranges = self.table.owned_ranges(me)
        params = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        lo, hi, max_scale = shard_bounds(params, ranges)
        ids = sorted(ranges)
        counts = torch.tensor([ranges[b][1] - ranges[b][0] for b in ids], dtype=torch.int64)
        self.table.update_owned(me, counts, lo, hi, max_scale, torch.ones(len(ids), dtype=torch.bool))
        if self.env.distributed:
            self.table.sync(me, self.env.world_size, self.log, "phase")

    def _refine(self, step: int, optimizers) -> None:
        """gsplat's DefaultStrategy schedule (grow/prune every refine_every, opacity reset), owners per block."""
        strategy = self.model.strategy
        if step >= strategy.refine_stop_iter:
            return
        grow = (step > strategy.refine_start_iter and step % strategy.refine_every == 0
                and step % strategy.reset_every >= strategy.pause_refine_after_reset)
        reset = step % strategy.reset_every == 0
        if not (grow or reset):
            return
        if grow:
            self._grow_and_prune(step, optimizers)
        if reset:
            self._reset_opacities(strategy.prune_opa * 2.0, optimizers)
        self._sync_table()
        if grow:
            self._rebuild_blocks(optimizers)
            if self.env.rank == 0:
                CONSOLE.log(f"Step {step}: {int(self.table.count.sum())} Gaussians in {self.table.num_blocks} blocks")
        self.runtime.structural_change()  # every block's last update size is unknown now

    def _grow_and_prune(self, step: int, optimizers) -> None:
        model, me = self.model, self.env.rank
        ranges = self.table.owned_ranges(me)
        triples = [(b, s, e) for b, (s, e) in sorted(ranges.items())]
        params = {n: model.gauss_params[n].detach() for n in PARAM_NAMES}
        opt_states = {n: dict(optimizers.optimizers[n].state.get(model.gauss_params[n], {})) for n in PARAM_NAMES}
        new_params, new_opt, new_state, counts, _ = refine_blocks(
            model.strategy, params, opt_states, model.strategy_state, triples, step, self.seed)
        for n in PARAM_NAMES:
            self._replace_param(n, new_params[n], new_opt[n], optimizers)
        model.strategy_state.update(new_state)
        ids = sorted(ranges)
        self.table.count[ids] = torch.tensor(counts, dtype=torch.int64)

    def _rebuild_blocks(self, optimizers) -> None:
        """Cut grown blocks, drop empty ones, rebalance and move blocks (see runtime.rebuild); then sync."""
        table, me, R = self.table, self.env.rank, self.env.world_size
        plan = plan_rebuild(table.count.numpy(), self.block_size)
        if not plan.changed:
            return
        owner = new_ownership(plan, table.owner.numpy(), R)
        cube = global_cube(table.lo, table.hi, table.count)
        ranges = table.owned_ranges(me)
        rows = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        for key in ("exp_avg", "exp_avg_sq"):
            for n in PARAM_NAMES:
                st = optimizers.optimizers[n].state.get(self.model.gauss_params[n], {})
                rows[f"{key}:{n}"] = st.get(key, torch.zeros_like(rows[n]))
        for k, v in self.model.strategy_state.items():
            if isinstance(v, torch.Tensor) and v.shape[0] == rows["means"].shape[0]:
                rows[f"state:{k}"] = v
        # this rank's pieces of the new blocks, cut from the old blocks it owns
        held: Dict[int, Dict[str, torch.Tensor]] = {}
        new_id = 0
        for b, k in enumerate(plan.pieces.tolist()):
            if b in ranges and k:
                s0, s1 = ranges[b]
                block = {name: t[s0:s1] for name, t in rows.items()}
                sizes = piece_sizes(s1 - s0, k)
                if k == 1:
                    order = torch.arange(s1 - s0, device=block["means"].device)
                elif self.block_cut == "kd":
                    order = kd_order(block["means"], sizes).to(block["means"].device)
                else:
                    order = morton_within(block["means"], cube)
                for j, piece in enumerate(cut_rows(block, order, sizes)):
                    held[new_id + j] = piece
            new_id += k
        # blocks whose owner changes travel (values unchanged), then each rank keeps its own in id order
        names = sorted(rows)
        widths = {name: rows[name].flatten(1).shape[1] if rows[name].dim() > 1 else 1 for name in names}
        holder = table.owner.numpy()[plan.parent]
        sends, shapes, incoming = {}, {}, {}
        for j in range(len(plan.parent)):
            src, dst = int(holder[j]), int(owner[j])
            if src == dst:
                continue
            if src == me:
                packed = torch.cat([held[j][n].reshape(int(plan.sizes[j]), widths[n]).float() for n in names], dim=1)
                sends.setdefault(dst, []).append(packed)
                del held[j]
            elif dst == me:
                incoming.setdefault(src, []).append(j)
        total = sum(widths.values())
        for src, ids in incoming.items():
            shapes[src] = (int(plan.sizes[ids].sum()), total)
        received = exchange({d: torch.cat(v) for d, v in sends.items()}, shapes, torch.float32, self.device,
                            self.log, "phase")
        for src, ids in incoming.items():
            start = 0
            for j in ids:
                n = int(plan.sizes[j])
                chunk, col = received[src][start:start + n], 0
                held[j] = {}
                for name in names:
                    w = widths[name]
                    held[j][name] = chunk[:, col:col + w].reshape((n,) + tuple(rows[name].shape[1:])).to(
                        rows[name].dtype)
                    col += w
                start += n
        mine = [j for j in range(len(plan.parent)) if int(owner[j]) == me]
        joined = {name: (torch.cat([held[j][name] for j in mine]) if mine else rows[name][:0]) for name in names}
        for n in PARAM_NAMES:
            self._replace_param(n, joined[n], {key: joined[f"{key}:{n}"] for key in ("exp_avg", "exp_avg_sq")},
                                optimizers)
        for k in list(self.model.strategy_state):
            if f"state:{k}" in joined:
                self.model.strategy_state[k] = joined[f"state:{k}"]
        B = len(plan.parent)
        self.table = BlockTable(owner=torch.as_tensor(owner, dtype=torch.int64),
                                count=torch.as_tensor(plan.sizes, dtype=torch.int64),
                                lo=torch.zeros(B, 3), hi=torch.zeros(B, 3), max_scale=torch.zeros(B),
                                version=torch.zeros(B, dtype=torch.int64))
        self.sharded.table = self.table
        self._sync_table()

    def _reset_opacities(self, value: float, optimizers) -> None:
        """gsplat's `reset_opa`: clamp opacities, zero their moments (elementwise, so shard-independent)."""
        model = self.model
        p = model.gauss_params["opacities"]
        clamped = torch.clamp(p.detach(), max=torch.logit(torch.tensor(value)).item())
        state = optimizers.optimizers["opacities"].state.get(p, {})
        self._replace_param("opacities", clamped,
                            {k: torch.zeros_like(v) for k, v in state.items() if k != "step"}, optimizers)

    def _replace_param(self, name: str, value: torch.Tensor, opt_state: Dict[str, torch.Tensor], optimizers) -> None:
        """Swap a Gaussian parameter for a new tensor, moving its optimizer state along (as gsplat's ops do)."""
        model = self.model
        old = model.gauss_params[name]
        optimizer = optimizers.optimizers[name]
        state = optimizer.state.pop(old, {})
        new = torch.nn.Parameter(value.contiguous())
        for k, v in opt_state.items():
            state[k] = v
        optimizer.param_groups[0]["params"] = [new]
        optimizer.state[new] = state
        model.gauss_params[name] = new
        optimizers.parameters[name] = [new]
