"""Fault injection for tests: a Gaussian moved outside its planned bounds (semantics 6), an error on every rank.

`ODIN_NS_FAULT_PUSH=STEP` picks the first step s >= STEP (inside one phase with s+1) where some view of step s+1
does not read a non-empty block; the owner of the first such block (in (rank, view, block) order of the plan, the
same for every split of the global batch) moves the block's first Gaussian onto that view's optical axis right after
its update of s. It fires once. No optimizer makes such a move (its motion is bounded),
so the plan's read sets miss it; the runtime must notice and still give the synchronous result. Every rank
applies the same rule to the same plan, so the runs of every policy push the same Gaussian to the same place.

`ODIN_NS_FAULT_RAISE=STEP`: every rank raises `InjectedFault` as step STEP begins, with the messages of the step
before in flight (the next reads' splats a rank sent and its peer will never receive): an error that is not a lost
peer, on every rank at once, as a full disk or a bug would raise it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist

PUSH_DEPTH = 1.0  # world units in front of the camera


class InjectedFault(RuntimeError):
    """The error `ODIN_NS_FAULT_RAISE` raises."""


@dataclass
class FaultInjection:
    push_step: Optional[int] = None
    fired: bool = False
    raise_step: Optional[int] = None

    @classmethod
    def from_environment(cls) -> "FaultInjection":
        push, fail = (os.environ.get(k, "").strip() for k in ("ODIN_NS_FAULT_PUSH", "ODIN_NS_FAULT_RAISE"))
        return cls(push_step=int(push) if push else None, raise_step=int(fail) if fail else None)

    def raise_at(self, step: int, rank: int) -> None:
        """Raise on every rank as `step` begins: after a barrier, so that no rank is stopped by the launcher or sees
        its peer gone before it raises (a barrier is a collective of its own: the sends stay in flight)."""
        if step != self.raise_step:
            return
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        raise InjectedFault(f"injected fault at step {step} on rank {rank} (ODIN_NS_FAULT_RAISE)")

    def apply(self, engine, step: int, params: Dict[str, torch.Tensor]) -> None:
        if self.push_step is None or self.fired or step < self.push_step:
            return
        plan, me = engine.plan, engine.env.rank
        target = step + 1
        for q in range(plan.num_ranks):
            for j, ids in enumerate(plan.view_reads(target, q)):
                for b in range(plan.num_blocks):
                    if b in ids or int(engine.table.count[b]) == 0:
                        continue
                    # The first candidate in global (view, block) order: the same in every split of the batch.
                    o = plan.owner[b]
                    if o != q and o not in plan.deps(target, q):
                        raise RuntimeError(
                            f"fault injection at step {step}: block {b} (rank {o}) is not read by view "
                            f"{plan.rank_views(target, q)[j]} of rank {q}, which waits for nothing of rank {o}; "
                            "no runtime can repair that miss, choose another ODIN_NS_FAULT_PUSH step")
                    if o == me:
                        self._push(engine, b, plan.rank_views(target, q)[j], params)
                    self.fired = True
                    return

    @staticmethod
    def _push(engine, block: int, view: int, params: Dict[str, torch.Tensor]) -> None:
        viewmat, _, _, _ = engine._projection(view, engine.model._get_downscale_factor())
        R, T = viewmat[0, :3, :3], viewmat[0, :3, 3]
        center = -R.T @ T
        forward = R.T @ torch.tensor([0.0, 0.0, 1.0])
        row = engine.runtime.ranges[block][0]
        with torch.no_grad():
            params["means"][row] = (center + PUSH_DEPTH * forward).to(params["means"])
        engine.runtime.mark_moved(row)  # published to its readers, and checked against the envelope
