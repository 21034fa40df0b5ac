"""Throughput-first's decisions on its communication lane (`runtime.lane`): a part of the engine.

The lane asks the rank whether a W's read is decided with the publications taken so far (`_decide_read`) and,
inline, whether an update would wait for a reader's gradients (`_lane_probe`); a call into the lane counts as a wait
only when the lane runs on a thread (`_lane_waiting`). `LaneDecisions` is a mixin: the state is the engine's.
"""

from __future__ import annotations

import contextlib

from odin_ns.runtime.lane import Lane


class LaneDecisions:
    """The lane of a throughput-first phase and the rank's answers to it (mixed into `runtime.engine.OdinEngine`)."""

    def _new_lane(self, step: int) -> Lane:
        """The communication lane of the phase starting at `step`, running the rank's program with the handlers,
        the read decisions and (inline) the probe."""
        self.own_pos = step - 1  # the version of its own blocks the rank's last read took
        return Lane(self.program, dict(self.handlers, decide=self._decide_read, probe=self._lane_probe),
                    name=f"odin-lane-r{self.env.rank}", mode=self.lane_mode)

    def _decide_read(self, action, until: int) -> bool:
        """A W of the lane: whether its read is decided with the publications up to update `until`."""
        step, me = action.step, self.env.rank
        if action.peer != me:
            return self.runtime.take_admitted(step, action.peer, until)
        version = self.runtime.own_admitted(step, self.own_pos, until)
        if version is None:
            return False
        self.own_pos = version
        self.splats.check_read(step, me, version)
        return True

    def _lane_waiting(self, cause: str):
        """Around a call into the lane: on a thread, the rank waits for it (`cause`); inline, the lane runs on the
        rank's thread and its own waits, update and packing count as what they are."""
        return self.log.waiting(cause) if self.lane_mode == "thread" else contextlib.nullcontext()

    def _lane_probe(self, action) -> bool:
        """Inline: whether every reader of the rank's blocks at `action.step` has sent its gradients of that step
        (each rank notes the last step whose gradients it sent, `SentMarks`; the gradients are on the pair after
        every earlier message, so the update would not wait). Which way it goes changes when the
        update runs, never what it computes nor what any render reads."""
        return self._sent.all_sent(self.plan.readers(action.step, self.env.rank), action.step)
