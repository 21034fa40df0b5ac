"""The whole model of a sharded run: checkpoints in, checkpoints out (a part of the engine).

nerfstudio saves and loads one model; a run's ranks each hold their owned blocks. Rank 0 gathers every block (and
the Adam moments) in block order for a checkpoint and the viewer (`gather_full`,
`gather_optimizer_states`), with what a resumed run needs beyond nerfstudio's keys to go on as if it never stopped
(`resume_state`); a loaded checkpoint is re-sharded on any rank count (`adopt_full_model`). `WholeModel` is a
mixin: the state is the engine's.
"""

from __future__ import annotations

import math
from typing import Dict

import torch
import torch.distributed as dist

from odin_ns.runtime.rebuild import largest_block
from odin_ns.runtime.sharded import PARAM_NAMES, ShardedGaussians, pack_params, unpack_params
from odin_ns.scene.block_refine import STATE_KEYS


class WholeModel:
    """Gather to rank 0 and re-shard from a whole model (mixed into `runtime.engine.OdinEngine`)."""

    @torch.no_grad()
    def adopt_full_model(self, moments: Dict[str, Dict[str, torch.Tensor]], optimizers,
                         resume: Dict | None = None, full: Dict[str, torch.Tensor] | None = None) -> None:
        """Shard a checkpoint's whole model (any rank count) with its moments: `full`, its Gaussian parameters as
        the checkpoint holds them (in host memory: the rank's own rows alone go to its device), or, without,
        the whole model loaded into this rank's model.

        `moments[name]` holds "exp_avg"/"exp_avg_sq" of the whole model and "step" (one number). `resume` is what
        an odin checkpoint adds (`resume_state`): its blocks, kept as they were (so a resumed run renders the
        same rows in the same order as one that never stopped), gsplat's densification statistics and
        throughput-first's evidence; without it (a plain splatfacto checkpoint) the model is cut afresh."""
        if full is None:
            full = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        full = dict(full)
        n_rows = full["means"].shape[0]
        for n in PARAM_NAMES:
            for key in ("exp_avg", "exp_avg_sq"):  # (the moments come from the checkpoint: in host memory)
                full[f"{key}:{n}"] = moments.get(n, {}).get(key, torch.zeros_like(full[n])).to(full[n].device)
        resume = resume or {}
        counts = resume.get("blocks")
        if counts is not None and (sum(counts) != n_rows or max(counts, default=0) > largest_block(self.block_size)):
            counts = None  # another model, or a smaller --pipeline.block-size: cut afresh (a block of the run may
            # hold up to twice the block size: a checkpoint at a refine step has such blocks, kept as they are)
        strategy = resume.get("strategy", {}) if counts is not None else {}
        for k, v in strategy.items():
            full[f"state:{k}"] = v.to(full["means"].device)
        mine, _ = self._shard_full(full, self.block_size, counts)
        mine = {k: t.to(self.device) for k, t in mine.items()}
        for n in PARAM_NAMES:
            optimizers.optimizers[n].state.clear()  # keyed by the Parameters the checkpoint load replaced
            self._replace_param(n, mine[n], {k: mine[f"{k}:{n}"] for k in ("exp_avg", "exp_avg_sq")}, optimizers)
            step = moments.get(n, {}).get("step")
            if step is not None:
                optimizers.optimizers[n].state[self.model.gauss_params[n]]["step"] = torch.as_tensor(
                    step, dtype=torch.float32).clone()
        for k in STATE_KEYS:
            self.model.strategy_state[k] = mine.get(f"state:{k}")
        self.sharded = ShardedGaussians(self.env, self.table, self.num_rest, self.device, self.log)
        self._new_runner()
        evidence = resume.get("evidence") if counts is not None else None
        if evidence is not None and self.staleness:
            self.runtime.rel_now = torch.as_tensor(evidence, dtype=torch.float64).tolist()
            self.runtime._structural = False

    def resume_state(self) -> Dict | None:
        """What a resumed run needs beyond nerfstudio's checkpoint to go on as if it never stopped (collective; rank
        0 gets it, None elsewhere): the block of every row (as counts, rows in block order), gsplat's densification
        statistics since the last refine, and throughput-first's evidence (each block's last update size)."""
        state = self.model.strategy_state
        n = self.model.gauss_params["means"].shape[0]
        columns = [state[k].reshape(n, 1).float() if isinstance(state.get(k), torch.Tensor) and state[k].shape[0] == n
                   else torch.zeros((n, 1), device=self.device) for k in STATE_KEYS]
        rows = torch.cat(columns, dim=1)
        full = self.sharded.gather_to(0, rows, to_host=True) if self.env.distributed else rows
        evidence = None
        if self.staleness:
            mine = self.runtime.evidence_of(self.table.owned(self.env.rank).tolist())
            every = [None] * self.env.world_size
            dist.all_gather_object(every, mine)
            evidence = torch.full((self.table.num_blocks,), math.inf, dtype=torch.float64)
            for part in every:
                for b, value in part.items():
                    evidence[b] = value
        if self.env.rank != 0:
            return None
        return {"blocks": self.table.count.tolist(),
                "strategy": {k: full[:, i].clone().cpu() for i, k in enumerate(STATE_KEYS)},
                "evidence": evidence}

    def gather_full(self, to_host: bool = False) -> Dict[str, torch.Tensor] | None:
        """Every block's parameters on rank 0 in block order (collective); None elsewhere. `to_host`: in host
        memory, one rank's rows on rank 0's device at a time (`ShardedGaussians.gather_to`): a checkpoint's."""
        owned_rows = pack_params({n: self.model.gauss_params[n] for n in PARAM_NAMES})
        if not self.env.distributed:
            return {n: t.to("cpu" if to_host else t.device, copy=True)
                    for n, t in unpack_params(owned_rows, self.num_rest).items()}
        rows = self.sharded.gather_to(0, owned_rows, to_host)
        if rows is None:
            return None
        return {n: t.contiguous() for n, t in unpack_params(rows, self.num_rest).items()}

    def gather_optimizer_states(self, optimizers, to_host: bool = False) -> Dict[str, Dict[str, torch.Tensor]] | None:
        """The Adam moments of every Gaussian on rank 0, in block order (collective); None elsewhere. `to_host`: as
        `gather_full`'s."""
        gathered: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n in PARAM_NAMES}
        for key in ("exp_avg", "exp_avg_sq"):
            owned = {}
            for n in PARAM_NAMES:
                param = self.model.gauss_params[n]
                owned[n] = optimizers.optimizers[n].state.get(param, {}).get(key, torch.zeros_like(param))
            rows = pack_params(owned)
            full = self.sharded.gather_to(0, rows, to_host) if self.env.distributed else \
                rows.cpu() if to_host else rows
            if full is None:
                continue
            for n, t in unpack_params(full, self.num_rest).items():
                gathered[n][key] = t.contiguous()
        return gathered if self.env.rank == 0 else None
