"""The planner of phases: the one place a `PhasePlan` is made.

Every rank of a run plans each phase with it (`runtime.engine`), and so do the offline preview (`odin-schedule`,
`odin-bench predict` on the built-in scenes and the fox: `schedule.preview`) and the prediction from points and
cameras (`schedule.geometry_plan`): the same views, read sets and lists wherever a plan is made.
- `view_read_masks`, `view_schedule`: which views every rank renders at every step (nerfstudio's seeded order, or
  Odin's by region, from each view's read set);
- `PhaseRules`: where a phase ends (splatfacto's refine schedule, SH degree changes, checkpoints, the end of
  training, the phase length and, on several ranks, the trainer's collectives on the default group: viewer
  refreshes, evaluations);
- `motion_bounds`: the rigorous bound on how far selective Adam moves a mean and grows a log-scale in the steps of
  a phase, from the optimizers' settings;
- `PhasePlanner.plan`: the views of every rank at every step (the view schedule) and each view's read set, from a
  batched test of the block table's bounds, inflated by those bounds, against the views' frustums (on several
  ranks each tests its own views and the ranks all-gather the results, bit-packed).
Written by hand: nerfstudio and gsplat have no notion of a phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from odin_ns.scene.read_sets import blocks_in_view, blocks_in_views, tight_step_bound
from odin_ns.schedule.odin_order import odin_schedule
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.views import ViewSchedule

NEAR_PLANE = 0.01  # the model's near plane (splatfacto's)


@dataclass
class PhaseRules:
    """What ends a phase. A refine step ends its phase, and so does a checkpoint step (every update applied before
    it is saved), a step after which the trainer runs a collective on several ranks (a viewer refresh's whole-model
    gather, an evaluation's renders from every owner's splats: collectives on the default group, which must not
    come between a pair's messages nor beside a communication lane still sending, and an evaluation renders the
    model as every update left it), the end of training and the phase length (a longer phase inflates its read
    sets by a larger motion bound); an SH degree change starts a phase. So no read is ever behind across a
    structural change."""

    phase_length: int = 25
    refine_start_iter: int = 0
    refine_stop_iter: int = 0  # 0: no refine step
    refine_every: int = 1
    reset_every: int = 1
    pause_refine_after_reset: int = 0
    sh_degree_interval: int = 0
    sh_degree: int = 0
    # the trainer's intervals of checkpoints and, on several ranks, of its collectives (evaluations, viewer
    # refreshes: `gather_intervals`), from step 1
    whole_model_every: Tuple[int, ...] = ()
    end_step: Optional[int] = None  # no phase plans messages past the last step

    @classmethod
    def of_model(cls, model, phase_length: int) -> "PhaseRules":
        st, cfg = model.strategy, model.config
        return cls(phase_length=phase_length, refine_start_iter=st.refine_start_iter,
                   refine_stop_iter=st.refine_stop_iter, refine_every=st.refine_every, reset_every=st.reset_every,
                   pause_refine_after_reset=st.pause_refine_after_reset, sh_degree_interval=cfg.sh_degree_interval,
                   sh_degree=cfg.sh_degree)

    def of_trainer(self, config, first_step: int, steps: int, distributed: bool) -> None:
        """The trainer's steps that end a phase (`config`: nerfstudio's TrainerConfig): its last, its checkpoints
        and, on several ranks, its evaluations and viewer refreshes (`gather_intervals`)."""
        self.end_step = first_step + steps
        every = [config.steps_per_save] + (list(gather_intervals(config)) if distributed else [])
        self.whole_model_every = tuple(k for k in every if k)

    def is_refine_step(self, step: int) -> bool:
        """gsplat's DefaultStrategy schedule: grow/prune every refine_every, opacity reset every reset_every."""
        if step >= self.refine_stop_iter:
            return False
        grow = (step > self.refine_start_iter and step % self.refine_every == 0
                and step % self.reset_every >= self.pause_refine_after_reset)
        return grow or step % self.reset_every == 0

    def sh_degree_changes_at(self, step: int) -> bool:
        """Splatfacto renders with SH degree min(step // sh_degree_interval, sh_degree)."""
        interval = self.sh_degree_interval
        return interval > 0 and step % interval == 0 and 0 < step // interval <= self.sh_degree

    def stop(self, start: int) -> int:
        """The first step after the phase that starts at `start`."""
        stop = start + max(1, self.phase_length)
        if self.end_step is not None:
            stop = min(stop, max(self.end_step, start + 1))
        for s in range(start, stop):
            if s > start and self.sh_degree_changes_at(s):
                return s
            if self.is_refine_step(s) or (s > 0 and any(s % k == 0 for k in self.whole_model_every)):
                return s + 1
        return stop


def eval_intervals(config) -> Tuple[int, ...]:
    """The steps between nerfstudio's evaluations (image, batch, all images) that run: only with a logger that
    takes them (its `check_eval_enabled`); 0 never. On several ranks every render of one is a collective: each
    owner projects its Gaussians for rank 0's camera (`runtime.eval_splats`)."""
    if not (config.is_wandb_enabled() or config.is_tensorboard_enabled() or config.is_comet_enabled()):
        return ()
    return tuple(k for k in (config.steps_per_eval_image, config.steps_per_eval_batch,
                             config.steps_per_eval_all_images) if k)


def gather_intervals(config) -> Tuple[int, ...]:
    """The steps between the trainer's collectives on the default group on several ranks, from step 1: its
    evaluations (renders from every owner's splats) and, where a viewer runs, its refreshes (a whole-model gather,
    `--pipeline.viewer-refresh-every`; the first before the first step)."""
    refresh = (config.pipeline.viewer_refresh_every,) if config.is_viewer_enabled() else ()
    return eval_intervals(config) + refresh


def view_read_masks(table, camera: Callable[[int], tuple], num_views: int) -> torch.Tensor:
    """[V, B] bool: the blocks of `table` each view's frustum meets (the initial model's read sets, no motion)."""
    return torch.stack([blocks_in_view(table.lo, table.hi, *camera(v), near=NEAR_PLANE, max_scale=table.max_scale)[0]
                        for v in range(num_views)])


def view_schedule(view_order: str, masks: Callable[[], torch.Tensor], counts: torch.Tensor, num_views: int,
                  num_ranks: int, micro_batch: int, seed: int,
                  costs: Optional[Callable[[], Sequence[float]]] = None):
    """nerfstudio's seeded random order ("random"), or Odin's ("odin": each view to the rank whose share of the
    blocks holds most of what it reads, from each view's read set, `masks()` ([V, B], asked only for Odin's), a
    step's views of alike cost, `costs()` per view (`schedule.visibility.visible_gaussians`; without, the
    Gaussians of its read set, `counts` per block))."""
    if view_order == "random":
        return ViewSchedule(num_views=num_views, num_ranks=num_ranks, micro_batch=micro_batch, seed=seed)
    if view_order != "odin":
        raise ValueError(f"unknown view order {view_order!r} (odin or random)")
    return odin_schedule(masks(), counts, num_ranks, micro_batch, seed, None if costs is None else costs())


def motion_bounds(optimizers, params, steps: int, done: Optional[int] = None) -> Tuple[List[float], List[float]]:
    """Per step i of a phase of `steps` steps: a rigorous bound on how far a mean can have moved (Euclidean) and a
    log-scale can have grown in the i selective-Adam steps since the phase started. `done`: Adam steps already
    taken, read from the optimizers unless given (a preview without training gives it)."""

    def bound(name: str, updates: int) -> float:
        opt = optimizers.optimizers[name]
        group = opt.param_groups[0]
        lr = max(float(group["lr"]), float(group.get("initial_lr", group["lr"])))
        state = opt.state.get(params[name], {})
        t = done if done is not None else (int(state["step"].item()) if "step" in state else 0)
        return sum(tight_step_bound(lr, group["betas"], t + 1 + i, group.get("bias_correction", True))
                   for i in range(updates))

    return ([math.sqrt(3.0) * bound("means", i) for i in range(steps)], [bound("scales", i) for i in range(steps)])


class PhasePlanner:
    """Plans phases of `num_ranks` ranks with `micro_batch` views each per step. `schedule.global_views(step)`
    gives every rank's views of a step; `camera(view)` a view's (viewmat [1, 4, 4], K [1, 3, 3], W, H) at the
    resolution read sets are tested at; `policy_name`, `staleness` and `admit_overlap` are what the plans carry."""

    def __init__(self, num_ranks: int, micro_batch: int, schedule, camera: Callable[[int], tuple],
                 policy_name: str = "quality", staleness: int = 0, admit_overlap: float = 0.0):
        self.num_ranks, self.micro_batch = num_ranks, micro_batch
        self.schedule, self.camera = schedule, camera
        self.policy_name, self.staleness, self.admit_overlap = policy_name, staleness, admit_overlap

    def plan(self, start: int, stop: int, table, motion: Sequence[float] = (), growth: Sequence[float] = (),
             share: Optional[Tuple[int, Callable[[torch.Tensor], List[torch.Tensor]]]] = None) -> PhasePlan:
        """Every rank derives the same plan of steps [start, stop) from the (synced) block table `table` (owner,
        count, lo, hi, max_scale per block): each view's read set is the blocks whose bounds, inflated by step i's
        `motion` and `growth` (zero where not given), meet its frustum, in one batched test. The plan keeps them as
        a tensor (`read_mask[i, q, j, b]`), each listed where a rank asks for it. With `share` = (this rank, an
        all-gather of one [views, bytes] uint8 tensor per rank) a rank tests only its own views and the ranks
        exchange the results, bit-packed:
        every view of the phase at every rank came to 3200 views x 2050 blocks at 64 ranks on the large city,
        3.5 s on two threads and GBs of temporaries at every phase start; the test is per (view, block), so the
        gathered mask is the one every rank would compute."""
        n, R, mb = stop - start, self.num_ranks, self.micro_batch
        motion, growth = list(motion) or [0.0] * n, list(growth) or [0.0] * n
        views = [self.schedule.global_views(step) for step in range(start, stop)]
        if share is None:
            flat = [(i, v) for i, step_views in enumerate(views) for rank_views in step_views for v in rank_views]
            mask = self._read_masks(table, flat, motion, growth)
        else:
            me, gather = share
            if any(len(rank_views) != mb for step_views in views for rank_views in step_views):
                raise ValueError(f"every rank renders {mb} view(s) a step")  # every rank refuses, none gathers
            parts = gather(self.rank_read_bits(start, stop, table, me, motion, growth))
            nb = len(table.count)
            mask = torch.stack([unpack_bits(p, nb).view(n, mb, nb) for p in parts], dim=1).reshape(n * R * mb, nb)
        # the reads stay a tensor; each rank lists those it asks for (`PhasePlan.view_reads`)
        plan = PhasePlan(start=start, stop=stop, num_ranks=R, owner=table.owner.tolist(), views=views,
                         policy_name=self.policy_name, motion=motion, growth=growth, staleness=self.staleness,
                         admit_overlap=self.admit_overlap, counts=table.count.tolist(),
                         read_mask=mask.view(n, R, mb, -1))
        return plan

    def rank_read_bits(self, start: int, stop: int, table, rank: int, motion: Sequence[float] = (),
                       growth: Sequence[float] = ()) -> torch.Tensor:
        """What `rank` sends in a phase's all-gather: its own views' read sets of steps [start, stop), step by
        step, bit-packed (uint8 [steps * micro_batch, ceil(blocks / 8)])."""
        n = stop - start
        motion, growth = list(motion) or [0.0] * n, list(growth) or [0.0] * n
        mine = [(i, v) for i in range(n) for v in self.schedule.global_views(start + i)[rank]]
        return pack_bits(self._read_masks(table, mine, motion, growth))

    def _read_masks(self, table, flat: List[Tuple[int, int]], motion: List[float], growth: List[float]
                    ) -> torch.Tensor:
        """Bool [len(flat), blocks]: the read sets of the (step index, view) pairs `flat`, empty blocks out."""
        cams = [self.camera(v) for _, v in flat]
        mask = blocks_in_views(table.lo, table.hi, torch.cat([c[0] for c in cams]), torch.cat([c[1] for c in cams]),
                               torch.tensor([c[2] for c in cams]), torch.tensor([c[3] for c in cams]),
                               table.max_scale, torch.tensor([motion[i] for i, _ in flat]),
                               torch.tensor([growth[i] for i, _ in flat]), near=NEAR_PLANE)
        return mask & (table.count > 0)[None, :]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool [n, b] -> uint8 [n, ceil(b / 8)], block b in bit b % 8 of byte b // 8 (numpy's packbits)."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy(), axis=1, bitorder="little"))


def unpack_bits(packed: torch.Tensor, b: int) -> torch.Tensor:
    """`pack_bits`' inverse: uint8 [n, ceil(b / 8)] -> bool [n, b]."""
    return torch.from_numpy(np.unpackbits(packed.cpu().numpy(), axis=1, count=b, bitorder="little").astype(bool))
