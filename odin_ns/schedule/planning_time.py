"""What a rank's planning of each phase costs: the prediction's phase starts, timed on this machine.

At each phase start every rank plans before its first step (`runtime.engine`): `PhasePlanner.plan` (its own views'
read sets tested, every rank's gathered), then what its steps will ask of the plan (`PhasePlan.prepare`) and its
own action list (`PhasePlan.actions`); the read sets' all-gather is the phase start's only message. The prediction
charges both to every phase: the work as this process times it, one process standing for rank 0 in the planner
(the other ranks' read sets made outside the clock, as the all-gather would hand them over) and for the slowest
rank in its lists, and the all-gather's bytes, which `gpu_costs` prices on the link. Left out: the rest of the
runtime's phase start (its channels' and splat path's set-up, the phase-start projections, which are render work)
and the view order's laying out of an epoch whose pattern of places is new (`OdinSchedule`, made once a pattern:
at most G / gcd(views, G) times a run, G the global batch), a start-up cost; each epoch's order of steps
(`_balanced_steps`) is counted in the phase that first reads it. On a GPU this work is the host's, with nothing of
the rank's to hide it: the host syncs once a step, and the phase's first step waits for its lists. Written here:
none of the field's trainers plans phases.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

from odin_ns.schedule.phase_planner import PhasePlanner
from odin_ns.schedule.plan import PhasePlan

TIMED_RANK = 0


@dataclass
class TimedPlans:
    plans: List[PhasePlan] = field(default_factory=list)
    planning_s: List[float] = field(default_factory=list)  # per phase: a rank's planning and its lists
    gather_bytes: List[int] = field(default_factory=list)  # per phase: the read sets a rank receives from the others


def plan_timed(planner: PhasePlanner, phases: Sequence[Tuple[int, int, Sequence[float], Sequence[float]]],
               table) -> TimedPlans:
    """The plans of `phases` ((start, stop, motion, growth) each) as rank `TIMED_RANK` of `planner.num_ranks`
    makes them, with what each cost (the module docstring). The plans are those of one process testing every
    view (the gathered read sets are the ones every rank would compute)."""
    out = TimedPlans()
    ranks = planner.num_ranks
    for start, stop, motion, growth in phases:
        outside = [0.0]

        def gather(mine):
            begun = time.perf_counter()
            parts = [mine if r == TIMED_RANK else planner.rank_read_bits(start, stop, table, r, motion, growth)
                     for r in range(ranks)]
            outside[0] += time.perf_counter() - begun
            return parts

        layout_before = getattr(planner.schedule, "new_pattern_s", 0.0)
        begun = time.perf_counter()
        plan = planner.plan(start, stop, table, motion, growth, (TIMED_RANK, gather) if ranks > 1 else None)
        spent = time.perf_counter() - begun - outside[0]
        spent -= getattr(planner.schedule, "new_pattern_s", 0.0) - layout_before
        lists = 0.0
        for r in range(ranks):  # each rank's own lists (the slowest starts the phase), the less of two tries on
            # copies of their own (a shared machine's pauses are not the rank's work)
            tries = []
            for _ in range(2):
                mine = dataclasses.replace(plan)
                begun = time.perf_counter()
                mine.prepare(r)
                mine.actions(r)
                tries.append(time.perf_counter() - begun)
            lists = max(lists, min(tries))
        out.plans.append(plan)
        out.planning_s.append(max(spent, 0.0) + lists)
        part = (stop - start) * planner.micro_batch * ((len(table.count) + 7) // 8)
        out.gather_bytes.append(part * (ranks - 1))
    return out
