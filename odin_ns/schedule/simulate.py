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

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from odin_ns.schedule.actions import Action
from odin_ns.schedule.plan import PhasePlan


class Deadlock(RuntimeError):
    pass


@dataclass
class Costs:
    """Seconds: render(view), one owner update per step, one message's latency, one phase boundary, and the
    per-step work that is neither rendering nor an update (bookkeeping, the training loop). With a link model
    (`bandwidth` in bytes/s and `message_bytes(sender, action)` for a G or P action), a message also occupies its
    sender's link for bytes / bandwidth: a rank's messages go out one after the other. A publication is a header (a
    few bytes: its reads are decided when it is in) and a payload per view (`message_parts`): a view renders once
    its own payloads are in."""

    render: Callable[[int], float]
    update: float = 0.002
    latency: float = 0.0003
    phase: float = 0.005
    overhead: float = 0.0
    bandwidth: float = math.inf
    message_bytes: Optional[Callable[[int, Action], float]] = None
    # a publication's payloads, one per view whose read takes its version: [(step, slot, bytes)] in the order they
    # travel (None, or no function: one payload, which every view waits for)
    message_parts: Optional[Callable[[int, Action], Optional[List[Tuple[int, int, float]]]]] = None
    # one processor per rank (a GPU): an update on the communication lane takes its time from the renders too
    # (a stream shares the GPU's cores); without it the lane has a processor of its own
    shared_compute: bool = False
    # what a run measured at (step, rank): (the views it rendered, their render time, its update, its bookkeeping
    # + loop). Where the replayed rank renders the same views at that step, the replay takes these, and so keeps
    # the run's step-to-step jitter (what ranks wait for); elsewhere the means above
    measured: Optional[Callable[[int, int], Optional[Tuple[Tuple[int, ...], float, float, float]]]] = None
    # throughput-first's lane runs inline, on the rank's own thread (`--pipeline.lane inline`): one processor per
    # rank runs both lanes, an earlier step's update before a render when its gradients are in (`runtime.lane`)
    inline_lane: bool = False
    # per phase, what its start takes every rank before its first step: its planning and the read sets' all-gather
    # (`schedule.planning_time`; the prediction's, none elsewhere)
    phase_start: Sequence[float] = ()

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
    """Advance every rank's clocks through its list of one phase (starting at step `start`); new clocks.

    A rank has a main lane (renders, and everything in lists without `on_thread` actions) and, for
    throughput-first lists, a communication lane (the `on_thread` actions, in list order): a render of step t
    waits until the lane has run every `W` of step t; the lane's `G` of a view waits until that view is rendered
    (an inline lane sends it before the step's next view renders). `W` waits for the publication of the version
    it reads (from itself: its own update of that step), `U` for every reader's gradients of its step, `B` for
    every rank."""
    ranks = sorted(actions)
    lanes = {r: ([a for a in actions[r] if not a.on_thread], [a for a in actions[r] if a.on_thread]) for r in ranks}
    pos = {r: [0, 0] for r in ranks}
    clock = {r: [clocks[r], clocks[r]] for r in ranks}  # [main, communication lane]
    phase_start = max(clocks)
    sent: Dict[Tuple, float] = {}  # ("P"|"G", src, dst, step, slot) -> time sent (a G per view: its slot)
    updated: Dict[Tuple[int, int], float] = {}  # (rank, step) -> when its update of that step was done
    rendered: Dict[Tuple[int, int], float] = {}  # (rank, step) -> when its last render of that step was done
    view_done: Dict[Tuple[int, int, int], float] = {}  # (rank, step, slot) -> when that view's render was done
    expected_grads: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}  # (owner, step) -> (reader, slot)
    views_at: Dict[Tuple[int, int], Tuple[int, ...]] = {}
    renders_left: Dict[Tuple[int, int], int] = {}
    waits_left: Dict[Tuple[int, int], int] = {}  # (rank, step) -> W actions of the lane not yet run
    for r in ranks:
        for a in actions[r]:
            if a.kind == "G":
                expected_grads.setdefault((a.peer, a.step), []).append((r, a.slot))
            elif a.kind == "R":
                views_at[(r, a.step)] = views_at.get((r, a.step), ()) + (a.view,)
                renders_left[(r, a.step)] = renders_left.get((r, a.step), 0) + 1
            elif a.kind == "W" and a.on_thread:
                waits_left[(r, a.step)] = waits_left.get((r, a.step), 0) + 1
    barrier_arrivals: Dict[int, Dict[int, float]] = {}
    link_free = {r: phase_start for r in ranks}  # when each rank's outgoing link is free again
    reads_taken: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}  # (rank, step) -> (owner, version) of its W's

    def publish(r: int, lane: int, t: float) -> None:
        """The run of P actions of one step from the lane's position, sent together: every header at once (its
        reads are decided with it), then the views' payloads, every reader's first view first (the runtime's
        order of the batch)."""
        todo, i = lanes[r][lane], pos[r][lane]
        group = []
        while i < len(todo) and todo[i].kind == "P" and todo[i].step == todo[pos[r][lane]].step:
            group.append(todo[i])
            i += 1
        wired = costs.message_bytes is not None and not math.isinf(costs.bandwidth)
        parts = {}
        for a in group:
            sent[("P", r, a.peer, a.step, -1)] = max(t, link_free[r]) if wired else t
            pieces = costs.message_parts(r, a) if wired and costs.message_parts is not None else None
            parts[a] = pieces if pieces is not None else [(None, None, costs.message_bytes(r, a) if wired else 0.0)]
        for k in range(max(len(p) for p in parts.values())):
            for a in group:
                if k < len(parts[a]):
                    step, slot, size = parts[a][k]
                    end = t
                    if wired:
                        end = link_free[r] = max(t, link_free[r]) + size / costs.bandwidth
                    sent[("p", r, a.peer, a.step, (step, slot))] = sent[("p", r, a.peer, a.step, "all")] = end

    def payloads_ready(r: int, step: int, slot: int) -> Optional[float]:
        """When the payloads of view `slot` of rank r at `step` are in, from every owner it read (None: not sent)."""
        times = []
        for o, version in reads_taken.get((r, step), []):
            if version < start:  # the phase start's state: there when the phase starts
                continue
            key = ("p", o, r, version, (step, slot))
            key = key if key in sent else ("p", o, r, version, "all")
            if key not in sent:
                return None
            times.append(sent[key] + costs.latency)
        return max(times, default=0.0)

    def send(r: int, a: Action, t: float) -> None:
        """A message of `a` leaves at `t`, or when the link is free, and is on the wire for bytes / bandwidth."""
        if costs.message_bytes is None or math.isinf(costs.bandwidth):
            sent[(a.kind, r, a.peer, a.step, a.slot)] = t
            return
        done = max(t, link_free[r]) + costs.message_bytes(r, a) / costs.bandwidth
        link_free[r] = done
        sent[(a.kind, r, a.peer, a.step, a.slot)] = done

    def grads_ready(r: int, a: Action) -> Optional[float]:
        messages = [("G", q, r, a.step, j) for q, j in expected_grads.get((r, a.step), [])]
        if any(m not in sent for m in messages):
            return None
        return max([sent[m] + costs.latency for m in messages], default=0.0)

    def publication_ready(r: int, a: Action) -> Optional[float]:
        needed = a.step - 1 - a.stale  # the update whose publication the read needs
        if needed < start:
            return phase_start
        if a.peer == r:
            return updated.get((r, needed))
        if ("P", a.peer, r, needed, -1) in sent:
            return sent[("P", a.peer, r, needed, -1)] + costs.latency
        return None

    force_render = set()  # inline ranks whose choice of update or render no later event can decide any more

    def inline_next(r: int) -> Optional[int]:
        """Inline lane (`runtime.lane`): which lane of rank r runs next (0 the render, 1 the lane), None when it
        cannot be decided yet: an earlier step's update goes before the render if every reader has sent its
        gradients by now, a reader that has not but may still (its clock is behind) leaves it open."""
        main, lane = lanes[r]
        if pos[r][1] >= len(lane):
            return 0
        if pos[r][0] >= len(main):
            return 1
        a, nxt = main[pos[r][0]], lane[pos[r][1]]
        if nxt.kind == "G" and nxt.step == a.step and (r, nxt.step, nxt.slot) in view_done:
            return 1  # a rendered view's gradients go out before the step's next view renders
        if pos[r][0] and main[pos[r][0] - 1].kind == "R" and main[pos[r][0] - 1].step == a.step:
            return 0  # the step's next view: its reads are decided
        if waits_left.get((r, a.step), 0) or (nxt.kind == "G" and nxt.step < a.step):
            return 1
        if nxt.step >= a.step:
            return 0
        if nxt.kind == "P":
            return 1 if lane[pos[r][1] - 1].kind in ("U", "P") else 0
        if nxt.kind != "U" or r in force_render:
            return 0
        now = clock[r][0]
        for q, j in expected_grads.get((r, nxt.step), []):
            if ("G", q, r, nxt.step, j) in sent:
                if sent[("G", q, r, nxt.step, j)] > now:
                    return 0
            elif min(clock[q]) <= now:
                return None
            else:
                return 0
        return 1

    def run_inline(r: int) -> bool:
        """Run rank r's lists as far as they go on one processor, in the order an inline lane takes."""
        moved = False
        while True:
            which = inline_next(r)
            if which is None or not run(r, which, once=True):
                return moved
            force_render.discard(r)
            clock[r][0] = clock[r][1] = max(clock[r])
            moved = True

    def run(r: int, lane: int, once: bool = False) -> bool:
        """Run lane `lane` of rank r as far as it goes (one action if `once`); whether it moved."""
        moved = False
        todo = lanes[r][lane]
        while pos[r][lane] < len(todo) and not (once and moved):
            a = todo[pos[r][lane]]
            t = clock[r][lane]
            if a.kind == "R":
                if waits_left.get((r, a.step), 0):
                    break  # the lane has not taken every publication of this step's reads yet
                ready = payloads_ready(r, a.step, len(views_at[(r, a.step)]) - renders_left[(r, a.step)])
                if ready is None:
                    break
                t = max(t, ready)
                per_view = costs.at(a.step, r, views_at[(r, a.step)])[0]
                cost = costs.render(a.view) if per_view is None else per_view
                clock[r][lane] = t + cost
                busy[r] += cost
                view_done[(r, a.step, len(views_at[(r, a.step)]) - renders_left[(r, a.step)])] = clock[r][lane]
                renders_left[(r, a.step)] -= 1
                if not renders_left[(r, a.step)]:
                    rendered[(r, a.step)] = clock[r][lane]
            elif a.kind == "W":
                ready = publication_ready(r, a)
                if ready is None:
                    break
                clock[r][lane] = max(t, ready)
                if a.peer != r:
                    reads_taken.setdefault((r, a.step), []).append((a.peer, a.step - 1 - a.stale))
                if a.on_thread:
                    waits_left[(r, a.step)] -= 1
                    if not waits_left[(r, a.step)]:
                        clock[r][0] = max(clock[r][0], clock[r][lane])  # the render starts after it
            elif a.kind == "G":
                if a.on_thread:  # after its view's render (a hand-written G without a slot: the step's renders)
                    if a.slot >= 0:
                        done = view_done.get((r, a.step, a.slot))
                    else:
                        done = None if renders_left.get((r, a.step), 0) else rendered.get((r, a.step), t)
                    if done is None:
                        break
                    t = clock[r][lane] = max(t, done)
                send(r, a, t)
            elif a.kind == "P":
                if ("P", r, a.peer, a.step, -1) not in sent:  # the first of its step's group sends them all
                    publish(r, lane, t)
            elif a.kind == "U":
                ready = grads_ready(r, a)
                if ready is None or (a.on_thread and renders_left.get((r, a.step), 0)):
                    break
                _, update, overhead = costs.at(a.step, r, views_at.get((r, a.step), ()))
                clock[r][lane] = max(t, ready, rendered.get((r, a.step), t)) + update
                busy[r] += update
                if lane == 1 and costs.shared_compute:  # the GPU's work is conserved: the renders finish later
                    clock[r][0] += update
                updated[(r, a.step)] = clock[r][lane]
                clock[r][0] += overhead  # the main thread's own bookkeeping of the step
                if costs.inline_lane:
                    clock[r][1] = clock[r][0] = clock[r][lane] + (overhead if lane else 0.0)
            elif a.kind == "B":
                arrivals = barrier_arrivals.setdefault(a.step, {})
                arrivals.setdefault(r, t)
                if len(arrivals) < len(ranks):
                    break
                clock[r][lane] = max(arrivals.values()) + costs.latency * max(1, math.ceil(math.log2(len(ranks))))
            pos[r][lane] += 1
            moved = True
        return moved

    while True:
        progressed = False
        for r in ranks:
            if costs.inline_lane:
                progressed |= run_inline(r)
                continue
            progressed |= run(r, 1)
            progressed |= run(r, 0)
        if all(pos[r][0] == len(lanes[r][0]) and pos[r][1] == len(lanes[r][1]) for r in ranks):
            return [max(clock[r]) + costs.phase for r in ranks]
        undecided = [r for r in ranks if costs.inline_lane and inline_next(r) is None]
        if not progressed and undecided:  # every rank that could still send is waiting: nobody sends before
            force_render.update(undecided)
            continue
        if not progressed:
            stuck = [f"rank {r} at {lanes[r][lane][pos[r][lane]]!r} (step {lanes[r][lane][pos[r][lane]].step})"
                     for r in ranks for lane in (0, 1) if pos[r][lane] < len(lanes[r][lane])]
            raise Deadlock("the plan deadlocks: " + "; ".join(stuck))


def simulate(plans: Sequence[PhasePlan], costs: Costs, actions: Sequence[Dict[int, Sequence[Action]]] = ()
             ) -> Prediction:
    """Predicted wall of consecutive phases (each ends in a global synchronization)."""
    if not plans:
        return Prediction()
    R = plans[0].num_ranks
    clocks, busy = [0.0] * R, [0.0] * R
    for i, plan in enumerate(plans):
        if i < len(costs.phase_start):
            clocks = [c + costs.phase_start[i] for c in clocks]
        lists = actions[i] if actions else {r: plan.actions(r) for r in range(R)}
        ends = simulate_phase(lists, plan.start, costs, clocks, busy)
        clocks = [max(ends)] * R
    wall = max(clocks)
    return Prediction(wall_s=wall, busy_s=busy, wait_s=[wall - b for b in busy])
