"""The interpreter of a rank's action list: the same list the simulator replays and `odin-schedule` prints.

A phase's list (`schedule.policies`) is cut once into what each seam of a training step runs:
- `pre[t]`: the actions before step t's renders (publications of the phase start, waits for the blocks read);
- `renders[t]`: the step's R actions (the engine renders those views);
- `between[t][j]`: what follows the render of the step's view j before its next view (that view's gradients out,
  while the next view renders);
- `post[t]`: what follows the last render (its gradients out, the update, publications, the barrier).
Throughput-first lists have a second lane (`on_thread` actions): it runs on the rank's communication thread in list
order, and `lane` holds it (`runtime.lane`). `run` hands each group of consecutive actions of one kind to its
handler with the step's context (a group's messages go out in one batch); `run_group` is the one place a handler
runs, here and on the lane, and names the rank, the phase and the action when it fails.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence

from odin_ns.schedule.actions import Action


class ActionError(RuntimeError):
    """A handler failed; the message names the rank, the phase and the action it was running."""


@dataclass
class StepContext:
    """What the handlers of one step's actions share: the step, the optimizers, its views' block ids (after the
    renders)."""

    step: int
    optimizers: Any
    view_ids: List[List[int]] = field(default_factory=list)


def run_group(program: "Program", group: List[Action], handler: Callable, *args) -> Any:
    """`handler(group, *args)`; a failure names the rank, the phase and the actions."""
    try:
        return handler(group, *args)
    except ActionError:
        raise
    except Exception as exc:
        raise ActionError(f"rank {program.rank}, phase {program.start}-{program.stop - 1}, step {group[0].step}: "
                          f"{', '.join(map(repr, group))}: {type(exc).__name__}: {exc}") from exc


class Program:
    """One rank's list of one phase, cut for the seams of a step (see the module docstring)."""

    def __init__(self, actions: Sequence[Action], rank: int, start: int, stop: int):
        self.actions = list(actions)
        self.rank, self.start, self.stop = rank, start, stop
        self.pre: Dict[int, List[Action]] = defaultdict(list)
        self.renders: Dict[int, List[Action]] = defaultdict(list)
        self.between: Dict[int, List[List[Action]]] = defaultdict(list)
        self.post: Dict[int, List[Action]] = defaultdict(list)
        self.lane: List[Action] = [a for a in self.actions if a.on_thread]
        pending: List[Action] = []
        current = None  # the step whose renders were seen last
        for a in self.actions:
            if a.on_thread:
                continue
            if a.kind == "R":
                if current != a.step:
                    self.pre[a.step] += pending
                    pending = []
                else:  # what followed the step's previous render runs before this one
                    self.between[a.step].append(self.post.pop(a.step, []))
                self.renders[a.step].append(a)
                current = a.step
            elif current is not None and a.step == current:
                self.post[current].append(a)
            else:
                pending.append(a)
        if pending and current is not None:
            self.post[current] += pending

    def run(self, actions: Sequence[Action], handlers: Dict[str, Callable], ctx: StepContext) -> None:
        """Each group of consecutive actions of one kind to `handlers[kind](group, ctx)`, in order."""
        i = 0
        while i < len(actions):
            j = i + 1
            while j < len(actions) and actions[j].kind == actions[i].kind and actions[j].step == actions[i].step:
                j += 1
            group = list(actions[i:j])
            run_group(self, group, handlers[group[0].kind], ctx)
            i = j
