"""The handlers of a rank's action kinds: each takes its group of actions and the step's context, and runs inline
(the pipeline's seams, `runtime.interpreter`) or on throughput-first's communication lane (`runtime.lane`), the same
code either way. A mixin of `runtime.engine.OdinEngine`, whose state (the plan, the runtime's shared state, the splat
path, the lane) they act on: W takes the publications a step's reads need, G sends a view's splat gradients to
their owners, U is the owners' update, P publishes the next reads' splats, B is odin-barrier's barrier."""

from __future__ import annotations

from typing import Dict

from odin_ns.runtime.interpreter import StepContext
from odin_ns.runtime.sharded import PARAM_NAMES


class ActionHandlers:
    """The action kinds' handlers by kind (`handlers`), as the interpreter and the lane call them."""

    @property
    def handlers(self) -> Dict:
        return {"W": self._take, "G": self._send_gradients, "U": self._update, "P": self._publish,
                "B": lambda group, ctx: self.runtime.barrier()}

    def _take(self, group, ctx: StepContext) -> None:
        self.runtime.take_current(ctx.step, [a.peer for a in group])

    def _send_gradients(self, group, ctx: StepContext) -> None:
        self.splats.send_gradients(ctx.step, [(a.slot, a.peer) for a in group])
        if self.lane is not None and self.lane_mode == "inline" and \
                group[0].slot in (-1, len(self.plan.rank_views(ctx.step, self.env.rank)) - 1):  # a group: one view
            self._sent.note(ctx.step)  # the owners' probe: this rank's gradients of the step are out

    def _update(self, group, ctx: StepContext) -> None:
        self._apply_update(ctx.step, ctx.optimizers)
        self.runtime.forget_step(ctx.step)
        self.splats.forget_step(ctx.step)

    def _publish(self, group, ctx) -> None:
        self.splats.publish(group[0].step, [a.peer for a in group])

    def _apply_update(self, step: int, optimizers) -> None:
        """U: the owners' update of `step` (the views' splat gradients back through the projections, every
        contribution in reference order, selective Adam on the touched rows), its learning-rate step, the check of
        the moved rows for the next step's reads, then every read that takes this version projected."""
        runtime, plan = self.runtime, self.plan
        track = step < self.model.strategy.refine_stop_iter
        readers = plan.readers(step, self.env.rank)
        if plan.staleness and runtime.channels is not None:
            runtime.drain(step, readers)  # publications ahead of the gradients on a pair
        runtime.apply(step, *self.splats.contributions(step, readers), optimizers, track)
        with self.log.nerfstudio():
            optimizers.scheduler_step_all(step)
        if plan.contains(step + 1):
            params = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
            self.fault.apply(self, step, params)
            runtime.check_envelope(step + 1, self._visible)
            self.splats.project_update(step)
        else:
            runtime.settle_evidence()  # the phase's last update: its evidence read on its own
