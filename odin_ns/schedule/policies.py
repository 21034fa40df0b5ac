"""The synchronization policies: one registry entry and one action-list generator each.

A policy is what decides, inside a phase, when a rank may render and what it waits for. Everything else (the
plan's views and read sets, the runtime that runs the lists, the simulator that replays them, the CLIs, the method
configs, the viewer panel) reads this registry: adding a policy is one `Policy` entry and its generator.

Generators turn a `PhasePlan` into each rank's program (`schedule.actions.Action`):
- `barrier` (odin-barrier): per step, wait for the publications of exactly the blocks read (W), render each view
  (R) and send its gradients to their owners (G: one message per view and owner, so that a view's gradients travel
  while the next view renders), update owned blocks (U), publish to next step's readers (P), then the global
  barrier (B): Grendel's synchronization, on the same per-block transport;
- `quality` (odin): the same without B: a rank waits only for the owners whose blocks its views read;
- `throughput` (odin-throughput): a rank's renders (the main lane) run beside a communication lane (`on_thread`)
  that receives, sends and updates: it sends a view's gradients once the view is rendered (while the step's next
  view renders); after a step's gradients leave, the lane takes the publications the next
  step's reads the plan admits one version behind (`~1`: already sent), lets the next render start, and only then
  updates its own blocks and publishes; reads the plan does not admit wait after that update. Admission is decided
  again at run time from the published evidence (a refused read waits after the update, as a current one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from odin_ns.schedule.actions import Action


@dataclass(frozen=True)
class Policy:
    name: str  # the pipeline's `--pipeline.policy` value
    method: str  # the ns-train / odin-train method
    description: str  # the method's description (ns-train --help)
    panel: str  # how the viewer panel names it
    label: str  # short name in tables
    barrier: bool  # a global barrier every step
    stale_reads: bool  # reads may be behind (the --pipeline.max-staleness, admit-* options apply)
    options: Tuple[str, ...]  # the pipeline options it reads beyond the common ones
    generator: Callable[..., List[Action]]  # (plan, rank) -> the rank's list for the phase
    when_exact: Optional[str] = None  # a policy with reads behind: whose program runs when none may be (staleness 0)

    def program_at(self, staleness: int) -> "Policy":
        """The entry whose lists run at this staleness: a policy with reads behind runs its exact counterpart's
        program when no read may be behind (`--pipeline.max-staleness 0`, or one rank)."""
        return POLICIES[self.when_exact] if self.stale_reads and not staleness and self.when_exact else self


def _exact(plan, rank: int, barrier: bool) -> List[Action]:
    """Every read current: the synchronous reference's order, with or without the global barrier."""
    out = _phase_start_publications(plan, rank, on_thread=False)
    versions = plan.versions()
    owned = plan.owned_blocks(rank)
    for i, step in enumerate(range(plan.start, plan.stop)):
        for o in plan.deps(step, rank):
            blocks = tuple(plan.publish_blocks(step, o, rank))
            out.append(Action("W", step, o, blocks, tuple(versions[i][b] for b in blocks)))
        for j, v in enumerate(plan.rank_views(step, rank)):
            out.append(Action("R", step, view=v))
            out += _gradients(plan, rank, step, j, on_thread=False)
        out.append(Action("U", step, blocks=tuple(sorted(plan.touched(step) & owned))))
        for q in plan.pub_readers(step, rank):
            out.append(Action("P", step, q, tuple(plan.pub_blocks(step, rank, q))))
        if barrier:
            out.append(Action("B", step))
    return out


def _gradients(plan, rank: int, step: int, slot: int, on_thread: bool) -> List[Action]:
    """The G actions of the rank's view in `slot` at `step`: one to every owner the rank reads at the step. A view
    that reads none of an owner's blocks in the plan has its message too, empty (the transport skips it), so that
    a block of that owner added to the view's read set after a detected miss has one."""
    return [Action("G", step, o, plan.view_grad_blocks(step, rank, slot, o), on_thread=on_thread, slot=slot)
            for o in plan.deps(step, rank)]


def _phase_start_publications(plan, rank: int, on_thread: bool) -> List[Action]:
    """The state at the phase start (update start-1), published to the ranks that read it first."""
    return [Action("P", plan.start - 1, q, tuple(plan.pub_blocks(plan.start - 1, rank, q)), on_thread=on_thread)
            for q in plan.pub_readers(plan.start - 1, rank)]


def barrier_actions(plan, rank: int) -> List[Action]:
    return _exact(plan, rank, barrier=True)


def quality_actions(plan, rank: int) -> List[Action]:
    return _exact(plan, rank, barrier=False)


def _lane_waits(plan, rank: int, step: int, versions, pos: Dict[int, Optional[int]], own: List[int],
                decided: set, early: bool) -> List[Action]:
    """The W actions of `step` on the communication lane, as the plan foresees them (every read it admits behind
    admitted at run time too). Early (before the rank's update of step-1): the reads admitted on publications up
    to update step-2, already sent; late (after that update): every read not decided early, current. `pos` is
    the last publication taken per owner, `own[0]` the version of its own blocks the rank last rendered; owners
    whose read of `step` is decided go into `decided`."""
    out: List[Action] = []
    i = plan.index(step)
    until = step - 2 if early else step - 1

    def wait(owner: int, version: int) -> None:
        k = step - 1 - version
        blocks = tuple(plan.publish_blocks(step, owner, rank))
        out.append(Action("W", step, owner, blocks, tuple(versions[i - k][b] for b in blocks), stale=k,
                          on_thread=True))
        decided.add(owner)

    if plan.publish_blocks(step, rank, rank) and rank not in decided:
        p = own[0]
        while p < until and not plan.schedule_admits(step, rank, rank, step - 1 - p):
            p += 1
        if p == step - 1 or (p <= until and plan.schedule_admits(step, rank, rank, step - 1 - p)):
            own[0] = p
            wait(rank, p)
    for o in plan.deps(step, rank):
        if o in decided:
            continue
        p, _, done = plan.advance(step, rank, o, pos[o], until=until)
        pos[o] = p
        if done:
            wait(o, p)
    return out


def throughput_actions(plan, rank: int) -> List[Action]:
    """Two lanes: renders (main) and a communication lane (`on_thread`) that lets the next render start before
    the rank's own update and publications, where the plan admits the next step's reads one version behind."""
    out = _phase_start_publications(plan, rank, on_thread=True)
    versions = plan.versions()
    owned = plan.owned_blocks(rank)
    pos: Dict[int, Optional[int]] = {o: None for o in range(plan.num_ranks) if o != rank}
    own = [plan.start - 1]
    out += _lane_waits(plan, rank, plan.start, versions, pos, own, set(), early=False)
    for step in range(plan.start, plan.stop):
        for j, v in enumerate(plan.rank_views(step, rank)):  # a view's gradients on the lane once it is rendered
            out.append(Action("R", step, view=v))
            out += _gradients(plan, rank, step, j, on_thread=True)
        decided: set = set()
        if step + 1 < plan.stop:
            out += _lane_waits(plan, rank, step + 1, versions, pos, own, decided, early=True)
        out.append(Action("U", step, blocks=tuple(sorted(plan.touched(step) & owned)), on_thread=True))
        for q in plan.pub_readers(step, rank):
            out.append(Action("P", step, q, tuple(plan.pub_blocks(step, rank, q)), on_thread=True))
        if step + 1 < plan.stop:
            out += _lane_waits(plan, rank, step + 1, versions, pos, own, decided, early=False)
    return out


POLICIES: Dict[str, Policy] = {p.name: p for p in (
    Policy(name="quality", method="odin", label="odin",
           description="Odin, quality-first: distributed Gaussian splatting, bit-for-bit the synchronous result.",
           panel="odin, quality-first (the synchronous result, no global barrier)",
           barrier=False, stale_reads=False, options=(), generator=quality_actions),
    Policy(name="throughput", method="odin-throughput", label="odin-throughput",
           description="Odin, throughput-first: bounded, admitted delayed reads across ranks.",
           panel="odin-throughput (reads admitted one version behind)",
           barrier=False, stale_reads=True, options=("max_staleness", "admit_overlap", "admit_update", "lane"),
           generator=throughput_actions, when_exact="quality"),
    Policy(name="barrier", method="odin-barrier", label="barrier",
           description="Distributed Gaussian splatting with a global barrier every step (the baseline).",
           panel="odin-barrier (a global barrier every step)",
           barrier=True, stale_reads=False, options=(), generator=barrier_actions),
)}
METHODS: Dict[str, Policy] = {p.method: p for p in POLICIES.values()}


def policy_of_method(method: str) -> Policy:
    return METHODS[method]
