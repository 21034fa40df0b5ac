"""Throughput-first's communication lane: the `on_thread` actions of a phase, run in list order.

With reads one version behind, a rank renders step t+1 from the version of update t-1 of the blocks it reads. That
hides another rank's lag only if the publication of update t-1 is taken, and this rank's own update of step t is
done, while the next render runs. So the rank's renders (the main thread, the engine's seams) and everything that
waits on other ranks (the lane) are apart: the lane runs the list's W, G, U and P actions in order (one thread
posts every message of the rank: the order on every pair of ranks is the list's), the main thread renders.

The lane and the renders meet at two points per step: a render of step t starts when every W of step t is decided
(`ready`); the lane's G of a view waits for that view's render (`rendered`: its gradients travel while the step's
next view renders, as the exact policies send them), its U for the step's renders (`put`). A W the plan admits
behind runs early, before the rank's update of step t-1; if the evidence refuses it, it runs again after that
update and its publications (current). Written here: torch.distributed has no such lane.

Where the lane runs (`--pipeline.lane`):
- `thread` (the default on GPUs): on a thread of its own (Python's threading), beside the renders (what the
  prediction for GPUs, `odin-bench predict`, models as a stream beside the renders' kernels).
- `inline` (the default on CPUs): on the rank's own thread, when it would otherwise wait. Before the render of
  step t+1 the rank runs the lane as far as that render's reads need (the gradients of step t out, the reads
  admitted behind taken), then its update of step t and the publications after it if every reader has already
  sent its gradients of step t (`probe`); if one has not, the rank renders t+1 first and updates after it,
  instead of waiting for the peer. Nothing competes with the renders for the processor (a thread takes the cores
  the renders need, and Python's lock), but a rank that renders first publishes its update a render later.
Either way the versions every render reads are the plan's (and the evidence's), never the timing's: both give the
same model bit for bit.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch

from odin_ns.runtime.interpreter import ActionError, Program, StepContext, run_group
from odin_ns.schedule.actions import Action


LANE_MODES = ("inline", "thread")


def resolve_lane(lane: str, device_type: str) -> str:
    """`--pipeline.lane`: auto is inline on CPU ranks (the ranks fill the cores; a thread takes them from the
    renders, measured no faster) and a thread on GPUs (the update is published while the next render runs: what
    the prediction for GPUs finds much better when messages take long)."""
    if lane == "auto":
        return "inline" if device_type == "cpu" else "thread"
    return lane


class Lane:
    """Runs `program.lane` with `handlers`, inline or on a thread (see the module docstring).

    handlers: the rank's handlers of G, U and P, (actions, the step's context), as the interpreter runs them;
    "decide" (a W action, until) -> whether its read is decided; inline, "probe" (a U action) -> whether every
    gradient it takes has been sent (it would not wait)."""

    def __init__(self, program: Program, handlers: Dict[str, Callable], name: str = "odin-lane",
                 mode: str = "thread"):
        if mode not in LANE_MODES:
            raise ValueError(f"unknown lane mode {mode!r} (choose from {', '.join(LANE_MODES)})")
        self.program = program
        self.handlers = handlers
        self._cond = threading.Condition()
        self._ready = set()
        self._given: Dict[int, StepContext] = {}
        self._views: Dict[int, Tuple[StepContext, int]] = {}  # step -> its context, how many views are rendered
        self.error: Optional[BaseException] = None
        self.done = False
        self._waits_left: Dict[int, int] = defaultdict(int)
        for a in program.lane:
            if a.kind == "W":
                self._waits_left[a.step] += 1
        self._deferred: Dict[int, List[Action]] = defaultdict(list)
        for step in range(program.start, program.stop):
            if not self._waits_left[step]:
                self._ready.add(step)
        self._next = 0  # inline: the first action of the list not run yet
        self._thread = None
        # the rank's GPU: a new thread starts on the first (NCCL hangs where the current device is not the rank's)
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        if mode == "thread":
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # ---- the main thread's side ---------------------------------------------------------------------------

    def ready(self, step: int) -> None:
        """Until every read of `step` is decided (its publications taken, its own version chosen)."""
        if self._thread is None:  # inline: as far as the reads need, the gradients of earlier steps out, and
            # an earlier step's update (and its publications) if every contribution it takes is already sent
            while self.error is None and not self.done and (step not in self._ready or self._sends_next(step)
                                                             or self._update_ready(step)):
                self._advance()
            self._raise()
            if step not in self._ready:
                raise ActionError(f"rank {self.program.rank}, phase {self.program.start}-{self.program.stop - 1}: "
                                  f"the communication lane ended before step {step}'s reads were decided")
            return
        with self._cond:
            while step not in self._ready and self.error is None:
                self._cond.wait(timeout=1.0)
        self._raise()

    def rendered(self, ctx: StepContext, slot: int) -> None:
        """View `slot` of the step is rendered (its gradients wait for G). Inline, the lane sends them now if they
        are its next actions (sends do not wait), before the step's next view renders."""
        with self._cond:
            self._views[ctx.step] = (ctx, slot + 1)
            self._cond.notify_all()
        if self._thread is None:
            lane = self.program.lane
            while self.error is None and self._next < len(lane) and lane[self._next].kind == "G" \
                    and lane[self._next].step == ctx.step and 0 <= lane[self._next].slot <= slot:
                self._advance()
        self._raise()

    def put(self, ctx: StepContext) -> None:
        """The step's renders are done (its splats' gradients wait for G)."""
        with self._cond:
            self._given[ctx.step] = ctx
            self._cond.notify_all()
        self._raise()

    def join(self) -> None:
        """Until the lane has run its whole list (the phase's end)."""
        if self._thread is None:
            while not self.done and self.error is None:
                self._advance()
            self._raise()
            return
        with self._cond:
            while not self.done and self.error is None:
                self._cond.wait(timeout=1.0)
        self._raise()

    def _sends_next(self, step: int) -> bool:
        """Inline: whether the next action sends an earlier step's gradients (they go out before a render)."""
        lane = self.program.lane
        return self._next < len(lane) and lane[self._next].kind == "G" and lane[self._next].step < step

    def _update_ready(self, step: int) -> bool:
        """Inline: whether the next action is an earlier step's update that would not wait (`probe`: every reader
        has sent its gradients), or the publications after one (sends do not wait)."""
        lane, i = self.program.lane, self._next
        if i >= len(lane) or lane[i].step >= step:
            return False
        if lane[i].kind == "P":
            return i > 0 and lane[i - 1].kind in ("U", "P")
        return lane[i].kind == "U" and "probe" in self.handlers and self.handlers["probe"](lane[i])

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- the lane --------------------------------------------------------------------------------------------

    def _context(self, step: int, last: bool, slot: int = -1) -> StepContext:
        """The step's context once its renders are done, or (`slot` >= 0) once that view is rendered (`last`: the
        lane's last use of it)."""
        def there() -> bool:
            return step in self._given or (slot >= 0 and self._views.get(step, (None, 0))[1] > slot)

        if self._thread is None and not there():
            what = f"view {slot} of step {step}" if slot >= 0 else f"step {step}'s renders"
            raise ActionError(f"rank {self.program.rank}: the lane needs {what} before it ran")
        with self._cond:
            while not there():
                self._cond.wait(timeout=1.0)
            if last:
                self._views.pop(step, None)
                return self._given.pop(step)
            return self._given[step] if step in self._given else self._views[step][0]

    def _decided(self, step: int, count: int = 1) -> None:
        with self._cond:
            self._waits_left[step] -= count
            if self._waits_left[step] <= 0 and not self._deferred[step]:
                self._ready.add(step)
                self._cond.notify_all()

    def _run(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while not self.done and self.error is None:
            self._advance()

    def _advance(self) -> None:
        """Run the next group of actions (consecutive actions of one kind and step, and of one view for G: a view's
        gradients go out once it is rendered); an error is kept in `error`."""
        lane = self.program.lane
        try:
            i = j = self._next
            while j < len(lane) and lane[j].kind == lane[i].kind and lane[j].step == lane[i].step \
                    and (lane[i].kind != "G" or lane[j].slot == lane[i].slot):
                j += 1
            if j > i:
                self._run_group(lane[i:j], later=lane[j:])
            self._next = j
            if j == len(lane):
                with self._cond:
                    self.done = True
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 (the thread hands it to the main thread, which raises it)
            if not isinstance(exc, ActionError):
                exc = ActionError(f"rank {self.program.rank}, phase {self.program.start}-{self.program.stop - 1}, "
                                  f"the communication lane: {type(exc).__name__}: {exc}")
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _run_group(self, group: List[Action], later: List[Action]) -> None:
        kind, step = group[0].kind, group[0].step
        if kind == "W":
            # early: before the update of step-1, on publications already sent
            early = any(a.kind == "U" and a.step == step - 1 for a in later)
            decided = run_group(self.program, group, lambda g: [self.handlers["decide"](a, step - 2 if early
                                                                                         else step - 1) for a in g])
            for a, done in zip(group, decided):
                if done:
                    self._decided(step)
                else:
                    with self._cond:
                        self._deferred[step].append(a)
                        self._waits_left[step] -= 1
        elif kind == "G":  # after its view's render
            run_group(self.program, group, self.handlers[kind], self._context(step, last=False, slot=group[0].slot))
        elif kind == "U":  # after the step's renders: the lane's last use of the step's context
            run_group(self.program, group, self.handlers[kind], self._context(step, last=True))
        elif kind == "P":
            run_group(self.program, group, self.handlers["P"], None)
        else:
            raise ActionError(f"{group[0]!r} cannot run on the communication lane")
        # after the update of `step` and its publications: the next step's refused reads, now current
        if kind in ("U", "P") and not (later and later[0].kind == "P" and later[0].step == step):
            deferred = self._deferred.pop(step + 1, [])
            for a in deferred:
                if not run_group(self.program, [a], lambda g: self.handlers["decide"](g[0], step)):
                    raise ActionError(f"rank {self.program.rank}: {a!r} undecided after the update it reads")
            with self._cond:
                if self._waits_left[step + 1] <= 0:
                    self._ready.add(step + 1)
                    self._cond.notify_all()
