"""Throughput-first's communication lane: the `on_thread` actions of a phase, run in list order on one thread.

With reads one version behind, a rank renders step t+1 from the version of update t-1 of the blocks it reads. That
hides another rank's lag only if the publication of update t-1 is taken, and this rank's own update of step t is
done, while the next render runs. So the rank's renders (the main thread, the engine's seams) and everything that
waits on other ranks (the lane) are apart: the lane runs the list's W, G, U and P actions in order (one thread
posts every message of the rank: the order on every pair of ranks is the list's), the main thread renders.

The lane and the renders meet at two points per step: a render of step t starts when every W of step t is decided
(`ready`); the lane's G of step t waits for that step's contributions (`put`). A W the plan admits behind runs
early, before the rank's update of step t-1; if the evidence refuses it, it runs again after that update and its
publications (current). Written here: torch.distributed has no such lane; it is Python's threading.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Dict, List, Optional

from odin_ns.runtime.interpreter import ActionError, Program
from odin_ns.schedule.actions import Action


class Lane:
    """Runs `program.lane` with `handlers` on a thread (see the module docstring).

    handlers: "W" (action, until) -> decided?; "G" (actions, contributions, view ids); "U" (action, the step's
    (contributions, view ids) when no G of the step took them, else None); "P" (actions)."""

    def __init__(self, program: Program, handlers: Dict[str, Callable], name: str = "odin-lane"):
        self.program = program
        self.handlers = handlers
        self._cond = threading.Condition()
        self._ready = set()
        self._given: Dict[int, tuple] = {}
        self.error: Optional[BaseException] = None
        self.done = False
        self._waits_left: Dict[int, int] = defaultdict(int)
        for a in program.lane:
            if a.kind == "W":
                self._waits_left[a.step] += 1
        self._deferred: Dict[int, List[Action]] = defaultdict(list)
        self._sent = set()  # steps whose contributions a G group took
        for step in range(program.start, program.stop):
            if not self._waits_left[step]:
                self._ready.add(step)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the main thread's side ---------------------------------------------------------------------------

    def ready(self, step: int) -> None:
        """Until every read of `step` is decided (its publications taken, its own version chosen)."""
        with self._cond:
            while step not in self._ready and self.error is None:
                self._cond.wait(timeout=1.0)
        self._raise()

    def put(self, step: int, contributions, view_ids) -> None:
        with self._cond:
            self._given[step] = (contributions, view_ids)
            self._cond.notify_all()
        self._raise()

    def join(self) -> None:
        """Until the lane has run its whole list (the phase's end)."""
        with self._cond:
            while not self.done and self.error is None:
                self._cond.wait(timeout=1.0)
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # ---- the lane --------------------------------------------------------------------------------------------

    def _contributions(self, step: int):
        with self._cond:
            while step not in self._given:
                self._cond.wait(timeout=1.0)
            return self._given.pop(step)

    def _decided(self, step: int, count: int = 1) -> None:
        with self._cond:
            self._waits_left[step] -= count
            if self._waits_left[step] <= 0 and not self._deferred[step]:
                self._ready.add(step)
                self._cond.notify_all()

    def _run(self) -> None:
        lane = self.program.lane
        try:
            i = 0
            while i < len(lane):
                j = i + 1
                while j < len(lane) and lane[j].kind == lane[i].kind and lane[j].step == lane[i].step:
                    j += 1
                group = lane[i:j]
                self._run_group(group, later=lane[j:])
                i = j
            with self._cond:
                self.done = True
                self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread, which raises it)
            if not isinstance(exc, ActionError):
                exc = ActionError(f"rank {self.program.rank}, phase {self.program.start}-{self.program.stop - 1}, "
                                  f"the communication lane: {type(exc).__name__}: {exc}")
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _run_group(self, group: List[Action], later: List[Action]) -> None:
        kind, step = group[0].kind, group[0].step
        try:
            if kind == "W":
                # early: before the update of step-1, on publications already sent
                early = any(a.kind == "U" and a.step == step - 1 for a in later)
                for a in group:
                    if self.handlers["W"](a, step - 2 if early else step - 1):
                        self._decided(step)
                    else:
                        with self._cond:
                            self._deferred[step].append(a)
                            self._waits_left[step] -= 1
            elif kind == "G":
                contributions, view_ids = self._contributions(step)
                self._sent.add(step)
                self.handlers["G"](group, contributions, view_ids)
            elif kind == "U":
                self.handlers["U"](group[0], None if step in self._sent else self._contributions(step))
                self._sent.discard(step)
            elif kind == "P":
                self.handlers["P"](group)
            else:
                raise ValueError(f"{group[0]!r} cannot run on the communication lane")
        except ActionError:
            raise
        except Exception as exc:
            raise ActionError(f"rank {self.program.rank}, phase {self.program.start}-{self.program.stop - 1}, "
                              f"step {step}: {', '.join(map(repr, group))}: {type(exc).__name__}: {exc}") from exc
        # after the update of `step` and its publications: the next step's refused reads, now current
        if kind in ("U", "P") and not (later and later[0].kind == "P" and later[0].step == step):
            deferred = self._deferred.pop(step + 1, [])
            for a in deferred:
                if not self.handlers["W"](a, step):
                    raise ActionError(f"rank {self.program.rank}: {a!r} undecided after the update it reads")
            with self._cond:
                if self._waits_left[step + 1] <= 0:
                    self._ready.add(step + 1)
                    self._cond.notify_all()
