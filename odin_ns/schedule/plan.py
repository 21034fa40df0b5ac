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

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from odin_ns.schedule.actions import Action


@dataclass(eq=False)
class PhasePlan:
    """Steps [start, stop) of one phase on `num_ranks` ranks.

    views[i][q]: the view indices rank q renders at step start+i; reads[i][q][j]: ascending block ids of that
    rank's view j (None where `read_mask` holds them, as the planner's plans do: `view_reads`, `all_reads`);
    owner[b]: the rank owning block b for the whole phase; versions count the steps of the phase in which some
    view read the block (a block nobody reads is not updated, so its version stays). Two plans are equal when
    their data (`to_dict`) are."""

    start: int
    stop: int
    num_ranks: int
    owner: List[int]
    views: List[List[List[int]]]
    reads: Optional[List[List[List[List[int]]]]] = None
    policy_name: str = "quality"  # the registry entry (schedule.policies) whose generator makes the lists
    motion: List[float] = field(default_factory=list)  # per step: bound on how far a mean moved since the start
    growth: List[float] = field(default_factory=list)  # per step: bound on how much a log-scale grew since then
    staleness: int = 0  # most versions a read may be behind (0: every read sees the newest, the exact policies)
    admit_overlap: float = 0.0  # the schedule's admission threshold (see `schedule_admits`)
    counts: List[int] = field(default_factory=list)  # Gaussians per block at the phase start (overlap weights)
    # read_mask[i, q, j, b]: the reads as a bool tensor (the planner's test gives it; without, made from `reads`,
    # a rank's missing slots all False)
    read_mask: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _memo: Dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop <= self.start:
            raise ValueError("a phase has at least one step")
        if self.reads is None and self.read_mask is None:
            raise ValueError("a plan needs its reads (lists or the read mask)")
        steps = len(self.reads) if self.reads is not None else self.read_mask.shape[0]
        if len(self.views) != self.stop - self.start or steps != len(self.views):
            raise ValueError("views and reads need one entry per step of the phase")
        if not self.motion:
            self.motion = [0.0] * len(self.views)
        if not self.growth:
            self.growth = [0.0] * len(self.views)
        if self.read_mask is None:
            self.read_mask = reads_mask(self.reads, self.num_ranks, len(self.owner))
        # what the queries below read, as tensors; each answer is made as a list when first asked (every rank plans
        # every phase, and asks mostly about its own views and its readers: at 64 ranks on the large city, sets
        # over all 3200 views' reads took 60 ms of a rank's planning on this machine)
        self._owner = torch.as_tensor(self.owner, dtype=torch.int64)
        self._union_mask, self._deps_mask = read_structure(self.read_mask, self._owner)
        if not self.counts:
            self.counts = [1] * len(self.owner)
        self._memo = {}  # (dataclasses.replace copies it: a plan with another staleness starts afresh)

    def prepare(self, rank: int) -> None:
        """List at once what `rank`'s steps ask of the plan, at its phase start (planning, timed as such; no
        step's operations): every rank's dependencies and readers at every step, the blocks of `rank` that each
        rank reads, every owner's blocks that `rank` reads, its views' reads, every step's touched blocks and,
        with reads behind (their overlaps), every rank's union. Each as the query would list it, one `nonzero`
        per kind for the whole phase."""
        n, R = self.read_mask.shape[:2]
        for key, lists in (("deps", _grouped(self._deps_mask)),
                           ("step_readers", _grouped(self._deps_mask.transpose(1, 2))),
                           *((("union", _grouped(self._union_mask)),) if self.staleness else ())):
            for g, ids in enumerate(lists):
                self._memo.setdefault((key, g // R, g % R), ids)
        mine = torch.nonzero(self._owner == rank).flatten()
        for g, ids in enumerate(_grouped(self._union_mask[:, :, mine], mine)):
            self._memo.setdefault(("by_owner", g // R, rank, g % R), ids)
        for i, ids in enumerate(_grouped(self._union_mask.any(dim=1))):
            self._memo.setdefault(("touched", i), frozenset(ids))
        views = _grouped(self.read_mask[:, rank])  # [steps * slots]
        slots = self.read_mask.shape[2]
        for i, union in enumerate(_grouped(self._union_mask[:, rank])):
            self._memo.setdefault(("union", i, rank), union)
            self._memo.setdefault(("reads", i, rank), views[i * slots:i * slots + len(self.views[i][rank])])
            by_owner: Dict[int, List[int]] = {o: [] for o in range(R)}
            for b in union:  # every owner's blocks this rank reads (a publication's to it)
                by_owner[self.owner[b]].append(b)
            for o, ids in by_owner.items():
                self._memo.setdefault(("by_owner", i, o, rank), ids)

    def _listed(self, key: tuple, make: Callable[[], object]):
        """The memo of the query named `key[0]` (each query its own name) for the rest of its key."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

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
        i = self.index(step)
        if self.reads is not None:
            return self.reads[i][rank]
        return self._listed(("reads", i, rank), lambda: [_ids(self.read_mask[i, rank, j])
                                                          for j in range(len(self.views[i][rank]))])

    def all_reads(self) -> List[List[List[List[int]]]]:
        """reads[i][q][j] for every step, rank and view (the plan's data)."""
        return [[self.view_reads(step, q) for q in range(self.num_ranks)] for step in range(self.start, self.stop)]

    def union_reads(self, step: int, rank: int) -> List[int]:
        """Ascending block ids any view of `rank` reads at `step`."""
        i = self.index(step)
        return self._listed(("union", i, rank), lambda: _ids(self._union_mask[i, rank]))

    def deps(self, step: int, rank: int) -> List[int]:
        """Owners (other than `rank`) of the blocks `rank` reads at `step`, ascending."""
        i = self.index(step)
        return self._listed(("deps", i, rank), lambda: _ids(self._deps_mask[i, rank]))

    def readers(self, step: int, owner: int) -> List[int]:
        """Ranks (other than `owner`) whose views read some block of `owner` at `step`, ascending."""
        i = self.index(step)
        return list(self._listed(("step_readers", i, owner), lambda: _ids(self._deps_mask[i, :, owner])))

    def view_grad_blocks(self, step: int, reader: int, slot: int, owner: int) -> Tuple[int, ...]:
        """Blocks of `owner` that `reader`'s view in `slot` reads at `step`, ascending (its gradient message's)."""
        return tuple(sorted(b for b in self.view_reads(step, reader)[slot] if self.owner[b] == owner))

    def publish_blocks(self, step: int, owner: int, reader: int) -> List[int]:
        """Blocks of `owner` that `reader` reads at `step` (what the publication of step-1 brings it)."""
        i = self.index(step)
        return list(self._listed(("by_owner", i, owner, reader),
                                 lambda: _ids(self._union_mask[i, reader] & self._owned_mask(owner))))

    def _owned_mask(self, rank: int) -> torch.Tensor:
        return self._listed(("owned_mask", rank), lambda: self._owner == rank)

    # ---- publications and the schedule's admission (throughput-first) ----------------------------------

    def window(self, update: int) -> range:
        """Steps whose reads the publication of `update` serves: update+1 .. update+1+staleness, in the phase."""
        return range(max(update + 1, self.start), min(update + 2 + self.staleness, self.stop))

    def pub_readers(self, update: int, owner: int) -> List[int]:
        """Ranks `owner` publishes update `update` to (start-1: the phase-start state), ascending."""
        return self._listed(("pub_readers", update, owner),
                            lambda: sorted({q for t in self.window(update) for q in self.readers(t, owner)}))

    def pub_blocks(self, update: int, owner: int, reader: int) -> List[int]:
        """Blocks of `owner` in its publication of `update` to `reader`: those `reader` reads in the window."""
        return self._listed(("pub_blocks", update, owner, reader), lambda: sorted(
            {b for t in self.window(update) for b in self.publish_blocks(t, owner, reader)}))

    def overlap(self, step: int, reader: int, owner: int, k: int) -> float:
        """Share of the Gaussians `reader` reads at `step` (counted by block) that lie in blocks of `owner` that
        the pending steps step-k .. step-1 update."""
        reads = self.union_reads(step, reader)
        total = sum(self.counts[b] for b in reads)
        pending = set().union(*(self.touched(t) for t in range(max(step - k, self.start), step)))
        hit = sum(self.counts[b] for b in reads if self.owner[b] == owner and b in pending)
        return hit / total if total else 0.0

    def schedule_admits(self, step: int, reader: int, owner: int, k: int) -> bool:
        """May `reader`'s read of `owner`'s blocks at `step` be k versions behind, as far as the plan knows?
        (Kept: the runtime asks again at every read and replay, and the overlap sums over the blocks read.)"""
        return self._listed(("admits", step, reader, owner, k),
                            lambda: 1 <= k <= min(self.staleness, step - self.start) and
                            self.overlap(step, reader, owner, k) <= self.admit_overlap)

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
        return self._listed(("owned", rank), lambda: frozenset(b for b, o in enumerate(self.owner) if o == rank))

    def touched(self, step: int) -> frozenset:
        """Blocks some view reads at `step` (the owners' update of the step may change them)."""
        i = self.index(step)
        return self._listed(("touched", i), lambda: frozenset(_ids(self._union_mask[i].any(dim=0))))

    def versions(self) -> List[List[int]]:
        """versions[i][b]: the version block b must be at when step start+i renders (0 at the phase start)."""
        read = self._union_mask.any(dim=1).to(torch.int64)  # [steps, blocks]: some view reads it
        return (torch.cumsum(read, dim=0) - read).tolist()

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
        return list(self._listed(("actions", rank), lambda: self.policy.generator(self, rank)))

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
                "views": self.views, "reads": self.all_reads(), "policy": self.policy_name,
                "motion": list(self.motion), "growth": list(self.growth), "staleness": self.staleness,
                "admit_overlap": self.admit_overlap, "counts": list(self.counts)}

    def __eq__(self, other) -> bool:
        if not isinstance(other, PhasePlan):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    @classmethod
    def from_dict(cls, d: Dict) -> "PhasePlan":
        # plans written before the plan carried its policy named it by two flags
        legacy = "barrier" if d.get("barrier") else "throughput" if d.get("staleness") else "quality"
        return cls(start=d["start"], stop=d["stop"], num_ranks=d["num_ranks"], owner=list(d["owner"]),
                   views=d["views"], reads=d["reads"], policy_name=d.get("policy", legacy),
                   motion=list(d.get("motion", [])), growth=list(d.get("growth", [])),
                   staleness=d.get("staleness", 0), admit_overlap=d.get("admit_overlap", 0.0),
                   counts=list(d.get("counts", [])))


def reads_mask(reads: List[List[List[List[int]]]], num_ranks: int, num_blocks: int) -> torch.Tensor:
    """Bool [steps, ranks, most views of a rank, blocks]: `reads` (per step, rank and view, block ids) as a
    tensor; a rank with fewer views has its last slots empty."""
    slots = max((len(per_rank) for step in reads for per_rank in step), default=0)
    mask = torch.zeros((len(reads), num_ranks, slots, num_blocks), dtype=torch.bool)
    at, ids = [], []
    for i, step in enumerate(reads):
        if len(step) != num_ranks:
            raise ValueError(f"step {i} of the reads lists {len(step)} ranks, not {num_ranks}")
        for q, per_rank in enumerate(step):
            for j, blocks in enumerate(per_rank):
                at.extend([(i * num_ranks + q) * slots + j] * len(blocks))
                ids.extend(blocks)
    bad = next((b for b in ids if type(b) is not int or not 0 <= b < num_blocks), None)
    if bad is not None:
        raise ValueError(f"block id {bad!r} of the reads is not one of the plan's {num_blocks} blocks")
    if ids:
        mask.view(-1, num_blocks)[torch.tensor(at, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)] = True
    return mask


def _ids(mask: torch.Tensor) -> List[int]:
    """The ascending indices of a 1-D bool tensor's True entries."""
    return torch.nonzero(mask).flatten().tolist()


def _grouped(mask: torch.Tensor, values: Optional[torch.Tensor] = None) -> List[List[int]]:
    """`_ids` of every row of `mask` [..., L] (rows in row-major order) at once: one `nonzero`; with `values` [L],
    the values at those indices."""
    rows = mask.reshape(math.prod(mask.shape[:-1]), mask.shape[-1])  # (a row may be empty: a rank owning none)
    hits = torch.nonzero(rows)
    counts = torch.bincount(hits[:, 0], minlength=rows.shape[0]).tolist()
    found = (hits[:, 1] if values is None else values[hits[:, 1]]).tolist()
    out, at = [], 0
    for c in counts:
        out.append(found[at:at + c])
        at += c
    return out


def read_structure(mask: torch.Tensor, owner: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """From `read_mask` [steps, ranks, views, blocks]: [steps, ranks, blocks] the blocks some view of the rank
    reads (their union), and [steps, ranks, ranks] the owners of those blocks other than the rank itself (its
    dependencies)."""
    n, R = mask.shape[:2]
    union = mask.any(dim=2)
    hits = torch.nonzero(union)
    deps = torch.zeros((n, R, R), dtype=torch.bool)
    deps[hits[:, 0], hits[:, 1], owner[hits[:, 2]]] = True
    deps[:, torch.arange(R), torch.arange(R)] = False
    return union, deps


def dependency_pairs(plan: PhasePlan) -> Dict[Tuple[int, int], int]:
    """{(reader, owner): number of steps at which the reader depends on the owner} over the phase."""
    out: Dict[Tuple[int, int], int] = {}
    for step in range(plan.start, plan.stop):
        for q in range(plan.num_ranks):
            for o in plan.deps(step, q):
                out[(q, o)] = out.get((q, o), 0) + 1
    return out

