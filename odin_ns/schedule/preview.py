"""The plan of a training run, made without training: what `odin-schedule` prints and writes.

It builds what a rank builds at start-up (nerfstudio's datamanager and the odin model from the same config,
the blocks and their owners for N ranks, the view order) in this one process, then plans the phases of the first K
steps with the planner every rank plans with at each phase start (`schedule.phase_planner`). Phases after a refine
step are planned at run time from the refined blocks; the preview plans them from the initial blocks (with the
optimizer's motion bound of their true step count), so their read sets are what an unchanged model would read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from nerfstudio.engine.optimizers import Optimizers

from odin_ns.render.viewmat import view_projection
from odin_ns.runtime.block_table import cut_blocks
from odin_ns.schedule.phase_planner import PhasePlanner, PhaseRules, motion_bounds, view_read_masks, view_schedule
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.planning_time import plan_timed
from odin_ns.schedule.policies import POLICIES
from odin_ns.schedule.visibility import view_gaussians, visible_gaussians, visible_share


@dataclass
class Preview:
    """Plans of consecutive phases and what the schedule needs about each view and block."""

    ranks: int
    plans: List[PhasePlan]
    gaussians_read: List[float]  # per training view, at the phase start (initial blocks)
    pixels: List[int]  # per training view, at the model's render resolution
    block_counts: List[int]
    block_extent: List[float]  # per block: the diagonal of its bound box / the diagonal of the scene's points
    num_views: int

    staleness: int = 1  # the run's --pipeline.max-staleness and --pipeline.admit-overlap (throughput-first)
    admit_overlap: float = 1.0
    visible: Optional[torch.Tensor] = None  # [views, blocks]: share of a block's rows in a view (message sizes)
    # per phase: a rank's planning as this process timed it, and the read sets it receives (`planning_time`)
    planning_s: List[float] = field(default_factory=list)
    gather_bytes: List[int] = field(default_factory=list)

    def policy_plans(self) -> Dict[str, List[PhasePlan]]:
        """The same views and read sets under each policy of the registry (throughput-first: reads behind
        wherever the plan admits them), by method name."""
        out = {}
        for p in POLICIES.values():
            staleness = self.staleness if p.stale_reads else 0
            out[p.method] = [dataclasses.replace(plan, policy_name=p.program_at(staleness).name, staleness=staleness,
                                                 admit_overlap=self.admit_overlap if p.stale_reads else 0.0)
                             for plan in self.plans]
        return out

    def to_dict(self) -> Dict:
        return {"ranks": self.ranks, "num_views": self.num_views,
                "blocks": {"count": self.block_counts, "extent": [round(e, 4) for e in self.block_extent]},
                "views": {"gaussians_read": self.gaussians_read, "pixels": self.pixels},
                "phases": [p.to_dict() for p in self.plans]}


def build_preview(config, ranks: int, steps: Optional[int] = None, first_step: int = 0) -> Preview:
    """Plans for steps [first_step, first_step + steps) of the run `config` (an OdinTrainerConfig) on `ranks`, with
    the recipe in steps of the run's global batch, as the trainer applies it; without `steps`, the whole run."""
    from odin_ns.recipe import apply_recipe

    config.pipeline.seed = config.machine.seed
    config = apply_recipe(config, ranks)[0]
    if steps is None:
        steps = config.max_num_iterations - first_step
    pipe = config.pipeline
    datamanager = pipe.datamanager.setup(device="cpu", test_mode="val", world_size=1, local_rank=0)
    from odin_ns.pipeline import setup_model  # the pipeline module imports the engine; keep this one light

    model = setup_model(pipe, datamanager, "cpu")
    datamanager.cached_train  # noqa: B018 (undistortion rewrites the cameras' intrinsics in place, as at start-up)
    initial = {n: model.gauss_params[n].detach().clone() for n in ("means", "scales")}
    order, table = cut_blocks(initial["means"], torch.exp(initial["scales"]), pipe.block_size, pipe.block_cut, ranks)
    downscale = model._get_downscale_factor()
    cameras = datamanager.train_dataset.cameras
    projections = [view_projection(cameras[v:v + 1], downscale) for v in range(len(datamanager.train_dataset))]
    masks = view_read_masks(table, projections.__getitem__, len(projections))  # as a rank's view order reads them
    blocked = initial["means"][order]
    sizes = {(p[2], p[3]) for p in projections}
    visible = None  # each view's share of each block's rows (the prediction's messages), where views share a size
    if len(sizes) == 1:
        (W, H), = sizes
        visible = visible_share(blocked, table.count, torch.cat([p[0] for p in projections]),
                                torch.cat([p[1] for p in projections]), W, H)
    # the view order's costs, as a rank makes them (`visible_gaussians`: the same shares where views share a size)
    schedule = view_schedule(pipe.view_order, lambda: masks, table.count, len(projections), ranks, pipe.micro_batch,
                             datamanager.config.train_cameras_sampling_seed,
                             lambda: view_gaussians(visible, table.count) if visible is not None else
                             visible_gaussians(blocked, table.count, projections))
    # as a rank plans (the trainer sets the end, the checkpoints and whole-model gathers: each ends its phase)
    rules = PhaseRules.of_model(model, pipe.phase_length)
    rules.of_trainer(config, first_step, steps, ranks > 1)
    policy = POLICIES[pipe.policy]  # the run's own lists (`policy_plans` gives every policy's)
    staleness = pipe.max_staleness if policy.stale_reads and ranks > 1 else 0
    planner = PhasePlanner(ranks, pipe.micro_batch, schedule, projections.__getitem__,
                           policy.program_at(staleness).name, staleness, pipe.admit_overlap if staleness else 0.0)
    optimizers = Optimizers(config.optimizers.copy(), model.get_param_groups())
    phases, start = [], first_step
    while start < first_step + steps:
        stop = rules.stop(start)
        phases.append((start, stop, *motion_bounds(optimizers, model.gauss_params, stop - start, done=start)))
        start = stop
    timed = plan_timed(planner, phases, table)
    gaussians = [float(table.count[m & (table.count > 0)].sum()) for m in masks]
    pixels = [W * H for _, _, W, H in projections]
    filled = table.count > 0
    scene = (table.lo[filled].amin(0), table.hi[filled].amax(0))
    scene_diag = float(torch.linalg.norm(scene[1] - scene[0])) or 1.0
    extent = [float(torch.linalg.norm(table.hi[b] - table.lo[b])) / scene_diag if filled[b] else 0.0
              for b in range(len(table.count))]
    return Preview(ranks=ranks, plans=timed.plans, gaussians_read=gaussians, pixels=pixels,
                   block_counts=table.count.tolist(), block_extent=extent, num_views=len(gaussians),
                   staleness=pipe.max_staleness, admit_overlap=pipe.admit_overlap, visible=visible,
                   planning_s=timed.planning_s, gather_bytes=timed.gather_bytes)
