"""The plan of one phase: who renders what, which blocks each view reads, and the actions that follow from it.

A phase is the run of steps between two global synchronization points (DESIGN.md semantics 5). At its start every
rank derives the same `PhasePlan` from replicated data (the view order, the block table, the motion bound), so no
request is ever needed inside the phase: every message, its sender, its receiver and the blocks it carries are
known in advance (only the number of rows a message carries depends on the data, and a small header says it).

From the per-view read sets follow, per step t and rank r:
- `deps(t, r)`: the owners whose blocks r's views read at t. r validates (waits) only for their publications of
  step t-1, and sends its gradients of step t to exactly them;
- `readers(t, o)`: the ranks whose views read some block of owner o at t (o waits for their gradients);
and from those the per-rank action lists (`actions`), with a readable repr in the style of PyTorch's pipelining
schedules: `W b3@v7 <-r1` (wait until block 3, owned by rank 1, is at version 7), `R v12`, `G s0 b3->r1`, `U b3`
(owner update once every contribution is in), `P b3->r0` (publish the new version to a rank that reads it next),
`B` (the global barrier, odin-barrier only).

Throughput-first (`staleness` > 0, DESIGN.md semantics 4): a publication of update u goes to every rank that
reads the owner's blocks at any of the steps u+1 .. u+1+staleness (the publication window), so that a reader
that skips the newest version of a block still holds the one before it. The plan's part of the admission is
`schedule_admits`: a read at step t may use the version of update t-1-k (k <= staleness, never from before the
phase start) when the share of the view's Gaussians in the owner's blocks that the pending steps t-k .. t-1
update is at most `admit_overlap`; the runtime's gradient evidence decides the rest (`runtime.admission`). The
action lists assume every read the plan admits is admitted (the prediction's upper bound); a stale wait reads
`W b3@v6 <-r1 ~1` (one version behind).

The plan is plain data: `to_dict` gives JSON, `actions_text` a diffable listing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

from odin_ns.schedule.actions import Action


@dataclass
class PhasePlan:
    """Steps [start, stop) of one phase on `num_ranks` ranks.

    views[i][q]: the view indices rank q renders at step start+i; reads[i][q][j]: ascending block ids of that
    rank's view j; owner[b]: the rank owning block b for the whole phase; versions count the steps of the phase
    in which some view read the block (a block nobody reads is not updated, so its version stays)."""

    start: int
    stop: int
    num_ranks: int
    owner: List[int]
    views: List[List[List[int]]]
    reads: List[List[List[List[int]]]]
    policy_name: str = "quality"  # the registry entry (schedule.policies) whose generator makes the lists
    motion: List[float] = field(default_factory=list)  # per step: bound on how far a mean moved since the start
    growth: List[float] = field(default_factory=list)  # per step: bound on how much a log-scale grew since then
    staleness: int = 0  # most versions a read may be behind (0: every read sees the newest, the exact policies)
    admit_overlap: float = 0.0  # the schedule's admission threshold (see `schedule_admits`)
    counts: List[int] = field(default_factory=list)  # Gaussians per block at the phase start (overlap weights)
    _union: List[List[List[int]]] = field(default_factory=list, repr=False, compare=False)
    _deps: List[List[List[int]]] = field(default_factory=list, repr=False, compare=False)
    _memo: Dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop <= self.start:
            raise ValueError("a phase has at least one step")
        if len(self.views) != self.stop - self.start or len(self.reads) != len(self.views):
            raise ValueError("views and reads need one entry per step of the phase")
        if not self.motion:
            self.motion = [0.0] * len(self.views)
        if not self.growth:
            self.growth = [0.0] * len(self.views)
        self._union = [[sorted({b for ids in per_rank for b in ids}) for per_rank in step] for step in self.reads]
        self._deps = [[sorted({self.owner[b] for b in blocks} - {q}) for q, blocks in enumerate(step)]
                      for step in self._union]
        if not self.counts:
            self.counts = [1] * len(self.owner)
        self._memo = {}  # (dataclasses.replace copies it: a plan with another staleness starts afresh)
        self._touched = [frozenset(b for blocks in step for b in blocks) for step in self._union]

    # ---- queries -----------------------------------------------------------------------------------------

    def index(self, step: int) -> int:
        if not self.start <= step < self.stop:
            raise IndexError(f"step {step} is outside the phase [{self.start}, {self.stop})")
        return step - self.start

    def contains(self, step: int) -> bool:
        return self.start <= step < self.stop

    @property
    def num_blocks(self) -> int:
        return len(self.owner)

    def rank_views(self, step: int, rank: int) -> List[int]:
        return self.views[self.index(step)][rank]

    def view_reads(self, step: int, rank: int) -> List[List[int]]:
        return self.reads[self.index(step)][rank]

    def union_reads(self, step: int, rank: int) -> List[int]:
        """Ascending block ids any view of `rank` reads at `step`."""
        return self._union[self.index(step)][rank]

    def deps(self, step: int, rank: int) -> List[int]:
        """Owners (other than `rank`) of the blocks `rank` reads at `step`, ascending."""
        return self._deps[self.index(step)][rank]

    def readers(self, step: int, owner: int) -> List[int]:
        """Ranks (other than `owner`) whose views read some block of `owner` at `step`, ascending."""
        i = self.index(step)
        return [q for q in range(self.num_ranks) if owner in self._deps[i][q]]

    def view_grad_blocks(self, step: int, reader: int, slot: int, owner: int) -> Tuple[int, ...]:
        """Blocks of `owner` that `reader`'s view in `slot` reads at `step`, ascending (its gradient message's)."""
        return tuple(sorted(b for b in self.view_reads(step, reader)[slot] if self.owner[b] == owner))

    def publish_blocks(self, step: int, owner: int, reader: int) -> List[int]:
        """Blocks of `owner` that `reader` reads at `step` (what the publication of step-1 brings it)."""
        key = ("by_owner", step, reader)
        if key not in self._memo:  # one pass over the reads per (step, reader), every owner at once
            by_owner: Dict[int, List[int]] = {}
            for b in self.union_reads(step, reader):
                by_owner.setdefault(self.owner[b], []).append(b)
            self._memo[key] = by_owner
        return list(self._memo[key].get(owner, ()))

    # ---- publications and the schedule's admission (throughput-first) ----------------------------------

    def window(self, update: int) -> range:
        """Steps whose reads the publication of `update` serves: update+1 .. update+1+staleness, in the phase."""
        return range(max(update + 1, self.start), min(update + 2 + self.staleness, self.stop))

    def pub_readers(self, update: int, owner: int) -> List[int]:
        """Ranks `owner` publishes update `update` to (start-1: the phase-start state), ascending."""
        key = ("readers", update, owner)
        if key not in self._memo:
            self._memo[key] = sorted({q for t in self.window(update) for q in self.readers(t, owner)})
        return self._memo[key]

    def pub_blocks(self, update: int, owner: int, reader: int) -> List[int]:
        """Blocks of `owner` in its publication of `update` to `reader`: those `reader` reads in the window."""
        key = ("blocks", update, owner, reader)
        if key not in self._memo:
            self._memo[key] = sorted({b for t in self.window(update) for b in self.publish_blocks(t, owner, reader)})
        return self._memo[key]

    def overlap(self, step: int, reader: int, owner: int, k: int) -> float:
        """Share of the Gaussians `reader` reads at `step` (counted by block) that lie in blocks of `owner` that
        the pending steps step-k .. step-1 update."""
        reads = self.union_reads(step, reader)
        total = sum(self.counts[b] for b in reads)
        pending = set().union(*(self._touched[self.index(t)] for t in range(max(step - k, self.start), step)))
        hit = sum(self.counts[b] for b in reads if self.owner[b] == owner and b in pending)
        return hit / total if total else 0.0

    def schedule_admits(self, step: int, reader: int, owner: int, k: int) -> bool:
        """May `reader`'s read of `owner`'s blocks at `step` be k versions behind, as far as the plan knows?
        (Kept: the runtime asks again at every read and replay, and the overlap sums over the blocks read.)"""
        key = ("admits", step, reader, owner, k)
        if key not in self._memo:
            self._memo[key] = 1 <= k <= min(self.staleness, step - self.start) and \
                self.overlap(step, reader, owner, k) <= self.admit_overlap
        return self._memo[key]

    def next_publication(self, owner: int, reader: int, after: int, until: int) -> int | None:
        """The first update in (after, until] whose publication `owner` sends to `reader` (None: none)."""
        for u in range(max(after + 1, self.start - 1), until + 1):
            if reader in self.pub_readers(u, owner):
                return u
        return None

    def advance(self, step: int, reader: int, owner: int, pos: int | None,
                admitted: Callable[[int], bool] | None = None,
                take: Callable[[int], None] | None = None, until: int | None = None) -> Tuple[int | None, bool, bool]:
        """`reader`'s read of `owner`'s blocks at `step`: from `pos` (the last publication of the owner's it took
        this phase; None: none yet), the owner's next publications in order, up to update `until` (default step-1),
        until the read is current (update step-1) or admitted behind: the plan's test (`schedule_admits`) and, where
        given, the runtime's evidence (`admitted(pos)`). `take(update)` is called for each publication taken.
        Returns the update the read renders (so far), whether an admission test ran, and whether the read is
        decided (current or admitted; False only when `until` stopped it first). The one rule shared by the
        runtime's validate, an owner's replay of its readers' decisions and the throughput policy's lists."""
        until = step - 1 if until is None else until
        tested = False
        while pos is None or pos < step - 1:
            if pos is not None and self.schedule_admits(step, reader, owner, step - 1 - pos):
                tested = True
                if admitted is None or admitted(pos):
                    return pos, tested, True
            nxt = self.next_publication(owner, reader, self.start - 2 if pos is None else pos, until)
            if nxt is None:
                return pos, tested, False
            pos = nxt
            if take is not None:
                take(pos)
        return pos, tested, True

    def owned_blocks(self, rank: int) -> frozenset:
        key = ("owned", rank)
        if key not in self._memo:
            self._memo[key] = frozenset(b for b, o in enumerate(self.owner) if o == rank)
        return self._memo[key]

    def touched(self, step: int) -> frozenset:
        """Blocks some view reads at `step` (the owners' update of the step may change them)."""
        return self._touched[self.index(step)]

    def versions(self) -> List[List[int]]:
        """versions[i][b]: the version block b must be at when step start+i renders (0 at the phase start)."""
        current = [0] * self.num_blocks
        out = []
        for i in range(len(self.views)):
            out.append(list(current))
            for b in {b for blocks in self._union[i] for b in blocks}:
                current[b] += 1
        return out

    # ---- the action lists ------------------------------------------------------------------------------

    @property
    def policy(self):
        """The registry entry whose program these lists are: the plan carries it."""
        from odin_ns.schedule.policies import POLICIES

        return POLICIES[self.policy_name]

    @property
    def barrier(self) -> bool:
        return self.policy.barrier

    def actions(self, rank: int) -> List[Action]:
        """The rank's whole phase as a list of actions, in the order the runtime runs them: the policy's
        generator (`schedule.policies`). Throughput-first lists assume every read the plan admits behind is
        admitted at run time too."""
        key = ("actions", rank)
        if key not in self._memo:
            self._memo[key] = self.policy.generator(self, rank)
        return list(self._memo[key])

    def actions_text(self) -> str:
        lines = []
        for r in range(self.num_ranks):
            lines.append(f"rank {r}:")
            step = None
            for a in self.actions(r):
                if a.step != step:
                    step = a.step
                    lines.append(f"  step {step}:")
                lines.append(f"    {a!r}")
        return "\n".join(lines)

    def to_dict(self) -> Dict:
        return {"start": self.start, "stop": self.stop, "num_ranks": self.num_ranks, "owner": list(self.owner),
                "views": self.views, "reads": self.reads, "policy": self.policy_name,
                "motion": list(self.motion), "growth": list(self.growth), "staleness": self.staleness,
                "admit_overlap": self.admit_overlap, "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, d: Dict) -> "PhasePlan":
        # plans written before the plan carried its policy named it by two flags
        legacy = "barrier" if d.get("barrier") else "throughput" if d.get("staleness") else "quality"
        return cls(start=d["start"], stop=d["stop"], num_ranks=d["num_ranks"], owner=list(d["owner"]),
                   views=d["views"], reads=d["reads"], policy_name=d.get("policy", legacy),
                   motion=list(d.get("motion", [])), growth=list(d.get("growth", [])),
                   staleness=d.get("staleness", 0), admit_overlap=d.get("admit_overlap", 0.0),
                   counts=list(d.get("counts", [])))


def dependency_pairs(plan: PhasePlan) -> Dict[Tuple[int, int], int]:
    """{(reader, owner): number of steps at which the reader depends on the owner} over the phase."""
    out: Dict[Tuple[int, int], int] = {}
    for step in range(plan.start, plan.stop):
        for q in range(plan.num_ranks):
            for o in plan.deps(step, q):
                out[(q, o)] = out.get((q, o), 0) + 1
    return out

