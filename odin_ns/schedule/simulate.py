"""Run per-rank action lists on a clock: predicted wall and waits of a phase, and a proof it cannot deadlock.

The same lists the runtime interprets (`PhasePlan.actions`), played with per-view render costs, an owner-update
cost, a message latency and a phase-boundary cost. Every rank advances through its list; an action that needs a
message (a publication for `W`, every reader's gradients for `U`, every rank at `B`) waits until the message's
sender has reached the matching action. If no rank can advance and some have actions left, the lists deadlock:
`Deadlock` names what each stuck rank waits for. Hand-written lists (a schedule JSON with "actions") are checked
the same way before anything runs (`odin-schedule --check`). Written here: PyTorch's pipelining simulator
checks its own action kinds, not these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from odin_ns.schedule.plan import Action, PhasePlan


class Deadlock(RuntimeError):
    pass


@dataclass
class Costs:
    """Seconds: render(view), one owner update per step, one message's latency, one phase boundary, and the
    per-step work that is neither rendering nor an update (bookkeeping, the training loop)."""

    render: Callable[[int], float]
    update: float = 0.002
    latency: float = 0.0003
    phase: float = 0.005
    overhead: float = 0.0
    # what a run measured at (step, rank): (the views it rendered, their render time, its update, its bookkeeping
    # + loop). Where the replayed rank renders the same views at that step, the replay takes these, and so keeps
    # the run's step-to-step jitter (what ranks wait for); elsewhere the means above
    measured: Optional[Callable[[int, int], Optional[Tuple[Tuple[int, ...], float, float, float]]]] = None

    def at(self, step: int, rank: int, views: Tuple[int, ...]) -> Tuple[Optional[float], float, float]:
        """(render of one of the rank's views, or None for the per-view cost; update; overhead) at `step`."""
        got = self.measured(step, rank) if self.measured else None
        if got is None or tuple(got[0]) != tuple(views):
            return None, self.update, self.overhead
        _, render, update, overhead = got
        return render / max(len(views), 1), update, overhead


@dataclass
class Prediction:
    wall_s: float = 0.0
    busy_s: List[float] = field(default_factory=list)  # per rank: render + update
    wait_s: List[float] = field(default_factory=list)  # per rank: everything else

    @property
    def ideal_s(self) -> float:
        """The busiest rank's render + update (DESIGN.md "Measuring"): no synchronization goes below it."""
        return max(self.busy_s, default=0.0)


def simulate_phase(actions: Dict[int, Sequence[Action]], start: int, costs: Costs,
                   clocks: List[float], busy: List[float]) -> List[float]:
    """Advance every rank's clock through its list of one phase (starting at step `start`); new clocks.

    A `U~` (throughput-first) runs on the rank's update thread: it starts when its gradients are in and the
    thread is free, the rank goes on rendering, and the publications listed after it leave when it is done; a
    `W` from the rank itself waits for that thread's update."""
    ranks = sorted(actions)
    pos = {r: 0 for r in ranks}
    clock = {r: clocks[r] for r in ranks}
    phase_start = max(clocks)
    sent: Dict[Tuple, float] = {}  # ("P"|"G", src, dst, step) -> time sent
    expected_grads: Dict[Tuple[int, int], List[int]] = {}  # (owner, step) -> readers
    for r in ranks:
        for a in actions[r]:
            if a.kind == "G":
                expected_grads.setdefault((a.peer, a.step), []).append(r)
    barrier_arrivals: Dict[int, Dict[int, float]] = {}
    views_at: Dict[Tuple[int, int], Tuple[int, ...]] = {}
    for r in ranks:
        for a in actions[r]:
            if a.kind == "R":
                views_at[(r, a.step)] = views_at.get((r, a.step), ()) + (a.view,)
    lane = dict(clock)  # the update thread's clock
    queued: Dict[int, List[Tuple[Action, float]]] = {r: [] for r in ranks}  # its work: (U~ or P, submitted at)
    updated: Dict[Tuple[int, int], float] = {}  # (rank, step) -> when its update thread applied that step

    def grads_ready(r: int, a: Action) -> Optional[float]:
        readers = expected_grads.get((r, a.step), [])
        if any(("G", q, r, a.step) not in sent for q in readers):
            return None
        return max([sent[("G", q, r, a.step)] + costs.latency for q in readers], default=0.0)

    def run_lane(r: int) -> bool:
        moved = False
        while queued[r]:
            a, submitted = queued[r][0]
            if a.kind == "P":
                sent[("P", r, a.peer, a.step)] = lane[r]
            else:
                ready = grads_ready(r, a)
                if ready is None:
                    return moved
                _, update, overhead = costs.at(a.step, r, views_at.get((r, a.step), ()))
                lane[r] = max(lane[r], ready, submitted) + update
                busy[r] += update
                updated[(r, a.step)] = lane[r]
            queued[r].pop(0)
            moved = True
        return moved

    while True:
        progressed = False
        for r in ranks:
            progressed |= run_lane(r)
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                if a.kind == "U" and a.on_thread:
                    queued[r].append((a, clock[r]))
                    _, _, overhead = costs.at(a.step, r, views_at.get((r, a.step), ()))
                    clock[r] += overhead  # the render thread's own bookkeeping of the step
                    progressed |= run_lane(r)
                elif a.kind == "P" and queued[r]:
                    queued[r].append((a, clock[r]))  # leaves when the update before it is done
                    progressed |= run_lane(r)
                elif a.kind == "R":
                    per_view = costs.at(a.step, r, views_at[(r, a.step)])[0]
                    cost = costs.render(a.view) if per_view is None else per_view
                    clock[r] += cost
                    busy[r] += cost
                elif a.kind in ("G", "P"):
                    sent[(a.kind, r, a.peer, a.step)] = clock[r]
                elif a.kind == "W":
                    needed = a.step - 1 - a.stale  # the update whose publication the read needs
                    if needed < start:
                        ready = phase_start
                    elif a.peer == r and (r, needed) in updated:
                        ready = updated[(r, needed)]
                    elif a.peer != r and ("P", a.peer, r, needed) in sent:
                        ready = sent[("P", a.peer, r, needed)] + costs.latency
                    else:
                        break
                    clock[r] = max(clock[r], ready)
                elif a.kind == "U":
                    ready = grads_ready(r, a)
                    if ready is None:
                        break
                    _, update, overhead = costs.at(a.step, r, views_at.get((r, a.step), ()))
                    clock[r] = max(clock[r], ready) + update + overhead
                    busy[r] += update
                elif a.kind == "B":
                    arrivals = barrier_arrivals.setdefault(a.step, {})
                    arrivals.setdefault(r, clock[r])
                    if len(arrivals) < len(ranks):
                        break
                    clock[r] = max(arrivals.values()) + costs.latency
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(actions[r]) and not queued[r] for r in ranks):
            return [max(clock[r], lane[r]) + costs.phase for r in ranks]
        if not progressed:
            stuck = [f"rank {r} at {actions[r][pos[r]]!r} (step {actions[r][pos[r]].step})"
                     for r in ranks if pos[r] < len(actions[r])]
            stuck += [f"rank {r}'s update thread at {queued[r][0][0]!r} (step {queued[r][0][0].step})"
                      for r in ranks if queued[r]]
            raise Deadlock("the plan deadlocks: " + "; ".join(stuck))


def simulate(plans: Sequence[PhasePlan], costs: Costs, actions: Sequence[Dict[int, Sequence[Action]]] = ()
             ) -> Prediction:
    """Predicted wall of consecutive phases (each ends in a global synchronization)."""
    if not plans:
        return Prediction()
    R = plans[0].num_ranks
    clocks, busy = [0.0] * R, [0.0] * R
    for i, plan in enumerate(plans):
        lists = actions[i] if actions else {r: plan.actions(r) for r in range(R)}
        ends = simulate_phase(lists, plan.start, costs, clocks, busy)
        clocks = [max(ends)] * R
    wall = max(clocks)
    return Prediction(wall_s=wall, busy_s=busy, wait_s=[wall - b for b in busy])


def parse_action(text: str, step: int) -> Action:
    """Inverse of `Action.__repr__` for one action of one step (hand-written lists in a schedule JSON)."""
    text = text.strip()
    if text == "B":
        return Action("B", step)
    kind, _, rest = text.partition(" ")
    if kind == "R":
        return Action("R", step, view=int(rest.lstrip("v")))
    if kind == "W":
        text, _, stale = text.partition(" ~")
        body, _, peer = text.rpartition("<-r")
        pairs = [w.strip().split("@v") for w in body.strip().split("W ")[1:]] if body.strip() else []
        return Action("W", step, int(peer), tuple(int(b.lstrip("b")) for b, _ in pairs),
                      tuple(int(v) for _, v in pairs), stale=int(stale or 0))
    if kind in ("U", "U~"):
        return Action("U", step, blocks=tuple(int(b.lstrip("b")) for b in rest.split(",") if b), on_thread=kind == "U~")
    if kind in ("G", "P"):
        blocks, _, peer = rest.rpartition("->r")
        return Action(kind, step, int(peer), tuple(int(b.lstrip("b")) for b in blocks.split(",") if b))
    raise ValueError(f"unknown action {text!r}")
