"""Is a (hand-edited) set of action lists the plan's program, possibly reordered?

`odin-schedule --check` replays the lists of a schedule JSON on the simulator, which finds deadlocks; but a
replay only checks the lists against themselves: a file with every `G` and `U` removed replays happily. So before
the replay the lists are compared with the ones the plan itself generates:
- per rank, the same actions (kind, step, peer, blocks, versions, staleness), each as often: nothing missing,
  nothing extra, no send to another rank, no wait for another version;
- its views rendered in the plan's order (a G names its view by its place among the step's renders);
- in an order the runtime can run: within a step a rank validates (`W`) before it renders (`R`), renders a view
  before it sends that view's gradients (`G`), renders every view before it updates (`U`), and publishes (`P`)
  after its update; an update run inline precedes the rank's next render (which reads the owned blocks it
  changes).
Reorderings that keep these (say, a gradient sent after the next step's wait) are allowed; whether they deadlock
is the simulator's to find. The first difference is reported in one line.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Sequence

from odin_ns.schedule.actions import Action
from odin_ns.schedule.plan import PhasePlan

# within one step, each kind must follow every action of the kinds listed for it
_AFTER = {"R": ("W",), "U": ("R",), "P": ("U",), "B": ("U", "P")}  # a G follows the render of its own view


def _key(a: Action):
    return (a.kind, a.step, a.peer, tuple(a.blocks), tuple(a.version), a.view, a.stale, a.on_thread, a.slot)


def _describe(a: Action) -> str:
    return f"step {a.step}: {a!r}"


def difference(plan: PhasePlan, rank: int, given: Sequence[Action]) -> Optional[str]:
    """None if `given` is the plan's list for `rank` (any order the rules above allow), else what differs."""
    expected = plan.actions(rank)
    want, have = Counter(map(_key, expected)), Counter(map(_key, given))
    by_key = {_key(a): a for a in list(expected) + list(given)}
    for k in want:
        if have[k] < want[k]:
            return f"rank {rank} lacks the plan's '{_describe(by_key[k])}'"
    for k in have:
        if have[k] > want[k]:
            return f"rank {rank} has '{_describe(by_key[k])}', which is not in the plan"
    renders: Dict[int, List[int]] = {}  # a step's views in the order the list renders them: a G's slot is a place
    for a in given:
        if a.kind == "R":
            renders.setdefault(a.step, []).append(a.view)
    for step, views in sorted(renders.items()):
        if views != list(plan.rank_views(step, rank)):
            return (f"rank {rank}: step {step} renders views {views}, where the plan's order is "
                    f"{list(plan.rank_views(step, rank))} (a G names its view by its place)")
    return _order_problem(rank, given)


def _order_problem(rank: int, given: Sequence[Action]) -> Optional[str]:
    last: Dict[tuple, int] = {}  # (step, kind) -> index of its last action
    first: Dict[tuple, int] = {}
    renders: Dict[int, List[int]] = {}  # step -> the indices of its renders, in order (a view's slot)
    for i, a in enumerate(given):
        last[(a.step, a.kind)] = i
        first.setdefault((a.step, a.kind), i)
        if a.kind == "R":
            renders.setdefault(a.step, []).append(i)
    for i, a in enumerate(given):
        if a.kind == "G":
            mine = renders.get(a.step, [])
            j = mine[a.slot] if 0 <= a.slot < len(mine) else None
            if j is None or j > i:
                return (f"rank {rank}: '{_describe(a)}' sends the gradients of a view "
                        f"{'it does not render' if j is None else 'before it renders it'} "
                        f"(a step runs {' -> '.join('WRGUPB')})")
        for before in _AFTER.get(a.kind, ()):
            j = last.get((a.step, before))
            if j is not None and j > i:
                return (f"rank {rank}: '{_describe(a)}' comes before '{_describe(given[j])}' of the same step "
                        f"(a step runs {' -> '.join('WRGUPB')})")
        if a.kind == "U" and not a.on_thread:
            j = first.get((a.step + 1, "R"))
            if j is not None and j < i:
                return (f"rank {rank}: '{_describe(given[j])}' renders before the update of step {a.step} it "
                        "reads ('" + _describe(a) + "')")
    return None


def check_lists(plans: Sequence[PhasePlan], lists: Sequence[Dict[int, List[Action]]]) -> Optional[str]:
    """The first phase whose lists are not its plan's, said in one line (None: all conform)."""
    for plan, per_rank in zip(plans, lists):
        for rank in range(plan.num_ranks):
            problem = difference(plan, rank, per_rank.get(rank, []))
            if problem is not None:
                return f"phase {plan.start}-{plan.stop - 1}: {problem}"
        extra = sorted(set(per_rank) - set(range(plan.num_ranks)))
        if extra:
            return f"phase {plan.start}-{plan.stop - 1}: lists for ranks {extra}, but the plan has {plan.num_ranks}"
    return None
