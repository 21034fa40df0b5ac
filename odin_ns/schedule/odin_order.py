"""Odin's view order: the same views per epoch as nerfstudio's, placed so that the views running at the same time,
and the views one rank runs next, share few blocks with what the other ranks are updating, with every rank's
summed cost balanced.

Each epoch is nerfstudio's seeded permutation of the training views (`ViewSchedule`'s), so every view is seen
once per epoch, and the epoch's views are a contiguous run of the global stream that steps are cut from (step t
takes positions [t*G, (t+1)*G), G = ranks x micro-batch, position p going to global slot p mod G; rank r holds
slots r*B .. r*B+B-1).

With regions (`view_affinity`, the default the engine builds): the blocks are cut into one contiguous share per
global slot (the way the initial ownership cuts them per rank), and each view goes to the slot whose share holds
most of the Gaussians it reads, as far as that slot's places in the epoch allow (views that lie mostly in one
share are placed first; those moved to a neighbour straddle the cut). A rank then mostly renders views of the
blocks it owns: it sends few gradients, receives few publications, and, on the exact path, waits for another rank
only when its next view reads blocks that rank has just updated, which happens near the cut only. Every slot
renders the same number of views per epoch, and the slots then trade views until each one's mean cost per view is
within `COST_TOLERANCE` of the epoch's as far as trades allow (the regions hold alike numbers of Gaussians, not
alike costs: a downtown's views see many more), giving up the least locality for it; and within the epoch a slot's
views are placed so that the views of one step cost alike (the i-th costliest of every slot in the same step, the
steps in a seeded random order), since where a step's views share blocks across ranks the exact path waits for the
step's slowest view.
Without regions (one slot, or `view_affinity` not given): a global batch starts with the earliest view not yet
placed and is filled with the view from the next `window` of the permutation that shares the fewest blocks with
the views already in it; then each step's views go to slots by decreasing cost, each to the slot with the lowest
summed cost so far (longest-processing-time first, over the whole run).

Locality and costs come from the initial model (read sets of its blocks and their Gaussian counts; a view's cost
is the Gaussians in its image, `schedule.visibility`, or without it the Gaussians of the blocks it reads): they
are known before training, identical on every rank and after a resume. The order depends only on the global batch
size, so one rank with a micro-batch of N views runs the same global batches as N ranks.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from odin_ns.scene.ownership import assign_contiguous

# how far above its share of an epoch's cost (by its number of views) the costliest slot may stay
COST_TOLERANCE = 0.05
TRADE_PARTNERS = 8  # the cheapest slots the costliest one looks for a trade in (at most G - 1)
TRADE_VIEWS = 32  # of each slot in a trade's candidates: the costliest of the costliest slot, the cheapest of others


def _ends(members: torch.Tensor, cost: torch.Tensor, costliest: bool) -> torch.Tensor:
    """The `TRADE_VIEWS` costliest (or cheapest) of `members` (indices into `cost`), all where they are fewer."""
    if len(members) <= TRADE_VIEWS:
        return members
    order = torch.sort(cost[members], descending=costliest, stable=True).indices
    return members[order[:TRADE_VIEWS]]


@dataclass
class OdinSchedule:
    """Views per (step, rank); same interface as `ViewSchedule`."""

    num_views: int
    num_ranks: int
    micro_batch: int
    seed: int
    view_blocks: Sequence[frozenset]  # per training view: the blocks it reads
    costs: Sequence[float]  # per training view: its predicted cost
    # per training view and global slot: how much of what the view reads lies in that slot's share of the blocks
    # (empty: no regions, views are grouped by overlap and placed by cost alone)
    view_affinity: Sequence[Sequence[float]] = ()
    window: int = 0  # 0: four global batches
    _stream: List[int] = field(default_factory=list, repr=False, compare=False)
    _steps: List[List[List[int]]] = field(default_factory=list, repr=False, compare=False)
    _loads: List[float] = field(default_factory=list, repr=False, compare=False)
    _view_cost: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _view_share: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _strength: List[float] = field(default_factory=list, repr=False, compare=False)
    _prefs: Optional[List[List[int]]] = field(default=None, repr=False, compare=False)
    _slot_cache: Dict[tuple, Dict[int, int]] = field(default_factory=dict, repr=False, compare=False)
    # seconds spent laying out epochs of a new pattern of places (once per pattern: a start-up cost, which the
    # prediction's planning times leave out, `schedule.planning_time`)
    new_pattern_s: float = field(default=0.0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_views < 1:
            raise ValueError("a schedule needs at least one training view")
        if self.num_ranks < 1 or self.micro_batch < 1:
            raise ValueError("ranks and micro-batch must be at least 1")
        if len(self.view_blocks) != self.num_views or len(self.costs) != self.num_views:
            raise ValueError("view_blocks and costs need one entry per training view")
        if self.view_affinity and (len(self.view_affinity) != self.num_views or
                                   any(len(a) != self.global_batch for a in self.view_affinity)):
            raise ValueError("view_affinity needs one entry per training view and global slot")
        self._rng = random.Random(self.seed)
        self._loads = [0.0] * self.global_batch  # per global slot (rank r holds slots r*B .. r*B+B-1)

    @property
    def global_batch(self) -> int:
        return self.num_ranks * self.micro_batch

    def _add_epoch(self) -> None:
        order = list(range(self.num_views))
        self._rng.shuffle(order)  # nerfstudio's permutation (the same draws as ViewSchedule)
        if self.view_affinity:  # the regions' layout needs no permutation: drawn all the same, as the epochs count
            self._stream.extend(self._regional_epoch())
            return
        G = self.global_batch
        window = self.window or 4 * G
        first = (G - len(self._stream) % G) % G or G  # the step boundary the epoch starts in
        remaining = order
        out: List[int] = []
        size = first
        while remaining:
            group = [remaining.pop(0)]
            while len(group) < size and remaining:
                candidates = remaining[:window]
                shared = [sum(len(self.view_blocks[c] & self.view_blocks[g]) for g in group) for c in candidates]
                best = min(range(len(candidates)), key=lambda k: (shared[k], k))
                group.append(remaining.pop(best))
            out.extend(group)
            size = G
        self._stream.extend(out)

    def _regional_epoch(self) -> List[int]:
        """One epoch laid out on the global stream so that the views of slot k (stream positions p with p mod G = k) are
        the views of k's region: each view goes to the slot its read set lies in most, as far as the slot's places in
        the epoch allow; views that lie mostly in one region are placed first (ties by view), so the ones moved to a
        neighbour are those that straddle the cut; then the slots' costs are balanced (`_balanced_slots`). That depends
        on the epoch only through its slots' numbers of places, so it is made once for each (an epoch's laying out took
        0.13 s at 4000 views x 128 slots). Within a slot the views are ordered so that a step's views cost alike
        (`_balanced_steps`)."""
        G, n, offset = self.global_batch, self.num_views, len(self._stream)
        places = [0] * G
        for i in range(n):
            places[(offset + i) % G] += 1
        key = tuple(places)
        if key not in self._slot_cache:  # the same places, the same slots: made once (epochs cycle through few)
            started = time.perf_counter()
            strength, prefs = self._regions()
            slot_of: Dict[int, int] = {}
            for v in sorted(range(n), key=lambda v: (-strength[v], v)):
                k = next(k for k in prefs[v] if places[k] > 0)  # its region's slot, or the next it lies in most
                slot_of[v] = k
                places[k] -= 1
            self._slot_cache[key] = self._balanced_slots(slot_of)
            self.new_pattern_s += time.perf_counter() - started
        return self._balanced_steps(self._slot_cache[key], offset, n)

    def _regions(self) -> Tuple[List[float], List[List[int]]]:
        """Per view, once: how much of what it reads lies in its strongest region (its largest affinity over their
        sum), and the slots by decreasing affinity (ties to the lower slot): where the regional epoch places it."""
        if self._prefs is None:
            self._strength = [max(a) / sum(a) if sum(a) > 0 else 0.0 for a in self.view_affinity]
            affinity = torch.tensor(self.view_affinity, dtype=torch.float64)
            self._prefs = torch.sort(-affinity, dim=1, stable=True).indices.tolist()
        return self._strength, self._prefs

    def _balanced_slots(self, slot_of: Dict[int, int]) -> Dict[int, int]:
        """`slot_of` with the slots' summed costs balanced: regions hold alike numbers of Gaussians, not alike
        costs (on the built-in street city at 8 ranks x 2 the costliest slot's views see 2.1x an epoch's mean, the
        cheapest 0.14x), and a rank renders its slots' views every step, so the costliest bounds every policy.
        While the costliest slot (by its mean cost per view: a slot renders one view a step) is more than
        `COST_TOLERANCE` above the epoch's mean, it trades one of its views for a cheaper one of another slot: of
        the trades that lower the larger of the two slots' costs, the one losing the least locality (the two
        views' shares of their reads in their own slot's region, given up for the other's; a gain of locality
        counts as none) per unit of cost it takes off (up to the slot's excess). Each slot keeps its number of
        views; a trade lowers the costliest slot and raises none above it. Written here: no library balances a
        partition's costs under fixed counts while keeping it near a given assignment."""
        views = sorted(slot_of)
        G = self.global_batch
        if self._view_share is None:  # per view: its cost, and the share of its reads in each slot's region
            self._view_cost = torch.tensor([float(c) for c in self.costs], dtype=torch.float64)
            totals = torch.tensor([max(sum(a), 1e-300) for a in self.view_affinity], dtype=torch.float64)
            self._view_share = torch.tensor(self.view_affinity, dtype=torch.float64) / totals[:, None]
        index = torch.tensor(views, dtype=torch.int64)
        cost, share = self._view_cost[index], self._view_share[index]
        slot = torch.tensor([slot_of[v] for v in views], dtype=torch.int64)
        # sums in Python, one after another: from the same costs every rank decides the same trades whatever its
        # processor's vector width (torch's reductions group their terms by it)
        loads, counts = [0.0] * G, [0] * G
        for v in views:
            loads[slot_of[v]] += float(self.costs[v])
            counts[slot_of[v]] += 1
        load = torch.tensor(loads, dtype=torch.float64)
        count = torch.tensor(counts, dtype=torch.float64)
        target = (count * (math.fsum(float(self.costs[v]) for v in views) / max(len(views), 1))).clamp(min=1e-300)
        for _ in range(8 * len(views)):
            level = load / target  # a slot's mean cost per view against the epoch's (what a step waits for)
            h = int(torch.argmax(level))
            if level[h] <= 1 + COST_TOLERANCE:
                break
            # the cheapest slots that have views this epoch (an epoch may be shorter than the global batch), and
            # of the trade's two sides the costliest views of h and the cheapest of each partner: a trade's
            # candidates stay few however many views a slot has
            partners = [k for k in torch.argsort(level, stable=True).tolist() if k != h and counts[k] > 0]
            partners = partners[:TRADE_PARTNERS]
            mine = _ends(torch.nonzero(slot == h).flatten(), cost, costliest=True)
            if not partners:
                break
            other = torch.cat([_ends(torch.nonzero(slot == k).flatten(), cost, costliest=False) for k in partners])
            there = slot[other]
            moved = cost[mine][:, None] - cost[other][None, :]  # cost [h]'s view takes off it
            after = torch.maximum((load[h] - moved) / target[h], (load[there][None, :] + moved) / target[there])
            gain = level[h] - after
            useful = torch.minimum(gain, level[h] - 1)  # what it takes off, up to what is too much
            lost = (share[mine, h][:, None] - share[mine][:, there]) + (share[other, there] - share[other, h])[None, :]
            score = torch.where(gain > 1e-9, (lost.clamp(min=0) + 1e-6) / useful.clamp(min=1e-300),
                                torch.full_like(gain, math.inf))
            best = int(torch.argmin(score))
            if not math.isfinite(float(score.flatten()[best])):
                break
            i, j = mine[best // len(other)], other[best % len(other)]
            k, d = int(slot[j]), float(moved.flatten()[best])
            slot[i], slot[j] = k, h
            load[h] -= d
            load[k] += d
        return {v: int(slot[i]) for i, v in enumerate(views)}

    def _balanced_steps(self, slot_of: Dict[int, int], offset: int, n: int) -> List[int]:
        """The epoch's stream positions [offset, offset + n) filled with each slot's views so that the views of a
        step cost alike: the epoch's whole steps are drawn in a seeded random order, then come its partial steps
        (the first and last, where the epoch's length is not a multiple of the global batch: they share their
        step with the epochs beside), and each slot's views, costliest first, take its places in that order. A
        whole step then gets the i-th costliest view of every slot (a slot absent from a step ranked before the
        whole ones would fall a place behind in every step after it); a partial one the cheapest views left, as
        the next epoch's part of that step does, so that a view the epoch before placed in the step they share
        trades places with its slot's next cheapest (no view twice in a step). On the exact path every rank waits
        for the step's slowest view (its gradients and publications), so the wait is the spread of a step's costs:
        on the built-in city the mean spread of a step's two views fell from 6.0 to 2.5 ms (the views' measured
        render times; 1.6 with them as the costs). The draw is its own generator's, seeded by the run's seed and
        the epoch's place, so nerfstudio's permutations stay the same draws."""
        G = self.global_batch
        rng = random.Random(f"{self.seed}:{offset}")
        steps = sorted({(offset + i) // G for i in range(n)})
        whole = [t for t in steps if t * G >= offset and (t + 1) * G <= offset + n]
        partial = [t for t in steps if t not in whole]
        rank_of_step = {s: k for k, s in enumerate(rng.sample(whole, len(whole)) + partial)}
        places: List[List[int]] = [[] for _ in range(G)]
        for i in range(n):
            places[(offset + i) % G].append(i)
        by_slot: List[List[int]] = [[] for _ in range(G)]
        for v in sorted(slot_of):
            by_slot[slot_of[v]].append(v)
        out = [-1] * n
        shared = offset // G if offset % G else None  # the step this epoch shares with the one before
        before = set(self._stream[offset - offset % G:offset])
        for k in range(G):
            views = sorted(by_slot[k], key=lambda v: (-self.costs[v], v))
            ranked = sorted(places[k], key=lambda i: rank_of_step[(offset + i) // G])  # costliest first
            for v, i in zip(views, ranked):
                out[i] = v
            for i in [i for i in ranked if (offset + i) // G == shared and out[i] in before]:
                j = next((j for j in reversed(ranked) if (offset + j) // G != shared and out[j] not in before), None)
                if j is not None:
                    out[i], out[j] = out[j], out[i]
        # where a slot had no such place of its own (an epoch of few steps), another slot's latest one
        for i in [i for i in range(n) if shared is not None and (offset + i) // G == shared and out[i] in before]:
            j = next((j for j in reversed(range(n)) if (offset + j) // G != shared and out[j] not in before), None)
            if j is not None:
                out[i], out[j] = out[j], out[i]
        return out

    def _step(self, step: int) -> List[List[int]]:
        G, B = self.global_batch, self.micro_batch
        while len(self._steps) <= step:
            t = len(self._steps)
            while len(self._stream) < (t + 1) * G:
                self._add_epoch()
            batch = self._stream[t * G:(t + 1) * G]
            if self.view_affinity:  # regions: a view's stream position is its slot
                self._steps.append([batch[r * B:(r + 1) * B] for r in range(self.num_ranks)])
                continue
            slots: List[int] = [-1] * G
            for v in sorted(batch, key=lambda v: (-self.costs[v], batch.index(v))):
                free = [k for k in range(G) if slots[k] < 0]
                k = min(free, key=lambda k: (self._loads[k], k))
                slots[k] = v
                self._loads[k] += self.costs[v]
            per_rank = [slots[r * B:(r + 1) * B] for r in range(self.num_ranks)]
            self._steps.append(per_rank)
        return self._steps[step]

    def views(self, step: int, rank: int) -> List[int]:
        return list(self._step(step)[rank])

    def global_views(self, step: int) -> List[List[int]]:
        return [list(v) for v in self._step(step)]

    def to_rows(self, first_step: int, num_steps: int) -> List[Dict[str, int]]:
        rows = []
        for step in range(first_step, first_step + num_steps):
            for rank in range(self.num_ranks):
                for slot, view in enumerate(self.views(step, rank)):
                    rows.append({"step": step, "rank": rank, "slot": slot, "view": view})
        return rows


def odin_schedule(masks: torch.Tensor, counts: torch.Tensor, num_ranks: int, micro_batch: int,
                  seed: int, costs: Optional[Sequence[float]] = None) -> OdinSchedule:
    """Odin's order for views whose read sets are `masks` (bool [views, blocks]) over blocks of `counts`
    Gaussians: a view's cost is `costs` (the Gaussians in its image) or, without them, the Gaussians it reads; its
    affinity to each global slot how many of those it reads lie in that slot's contiguous share of the blocks
    (the cut the initial ownership makes per rank)."""
    masks = masks & (counts > 0)[None, :]
    slots = num_ranks * micro_batch
    share = torch.as_tensor(assign_contiguous(counts.numpy().astype(float), slots).owner)
    weights = masks.to(torch.float64) * counts.to(torch.float64)[None, :]
    costs = weights.sum(dim=1).tolist() if costs is None else [float(c) for c in costs]
    if len(costs) != masks.shape[0]:
        raise ValueError(f"{len(costs)} view costs for {masks.shape[0]} views")
    affinity = torch.zeros(masks.shape[0], slots, dtype=torch.float64).index_add_(1, share, weights).float()
    blocks = [frozenset(torch.nonzero(m).flatten().tolist()) for m in masks]
    return OdinSchedule(num_views=len(blocks), num_ranks=num_ranks, micro_batch=micro_batch, seed=seed,
                        view_blocks=blocks, costs=costs, view_affinity=affinity.tolist() if slots > 1 else ())
