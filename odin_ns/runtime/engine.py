"""The engine of one rank: the synchronous reference of DESIGN.md, run on sharded Gaussians, phase by phase.

At a phase's start every rank derives the same `PhasePlan` from replicated data (the views of every rank at every
step, their read sets from the block table's bounds inflated by the optimizer's largest motion: each rank tests its
own views in one batched test and the ranks all-gather the results) and takes its own program of the phase from the
policy registry (`schedule.policies`). The pipeline's seams run the program step by step (`runtime.interpreter`):
`validate` the actions before the step's renders (the owners' splats in), `render` its views, `publish` what follows
(the splats' gradients out, the owners' update, the next reads' splats out, odin-barrier's barrier; the action
kinds' handlers are `runtime.action_handlers`);
throughput-first runs its communication on a lane beside the renders (`runtime.lane`; its decisions
`runtime.lane_decisions`). What travels is splats (`runtime.splat_path`); the state the handlers share is
`runtime.rank_runtime`, reads behind are `runtime.admission`; phases are planned by `schedule.phase_planner`; phase
boundaries (densify, prune, cut, rebalance, the table's sync) are `runtime.boundary`, checkpoints in and out
`runtime.whole_model`, the read sets' check `runtime.read_set_check`. The result does not depend on how many ranks
share the global batch: N ranks with one view each equal one rank with a micro-batch of N views, bit for bit. """

from __future__ import annotations

import functools
import json
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nerfstudio.models.splatfacto import num_sh_bases

from odin_ns.render.viewmat import view_projection
from odin_ns.runtime.block_table import cut_blocks
from odin_ns.runtime.action_handlers import ActionHandlers
from odin_ns.runtime.boundary import PhaseBoundary
from odin_ns.runtime.dist_env import DistEnv
from odin_ns.runtime.fault_injection import FaultInjection
from odin_ns.runtime.interpreter import Program, StepContext
from odin_ns.runtime.lane import Lane, resolve_lane
from odin_ns.runtime.lane_decisions import LaneDecisions
from odin_ns.runtime.op_count import OpCounter
from odin_ns.runtime.projection_memory import ProjectionMemory, device_memory, keep_budget
from odin_ns.runtime.rank_runtime import RankRuntime
from odin_ns.runtime.read_set_check import ReadSetCheck
from odin_ns.runtime.sent_marks import SentMarks
from odin_ns.runtime.splat_path import SplatPath
from odin_ns.runtime.sharded import PARAM_NAMES, ShardedGaussians, gathered_rows
from odin_ns.runtime.transport import RECORD_ENV, all_gather_rows, channels_group
from odin_ns.runtime.waits import WaitLog
from odin_ns.runtime.whole_model import WholeModel
from odin_ns.schedule.phase_planner import PhasePlanner, PhaseRules, motion_bounds, view_read_masks, view_schedule
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.policies import POLICIES
from odin_ns.schedule.visibility import visible_gaussians

SENT_KEY = "odin/lane/gradients-sent/"  # the inline lanes' notes in the job's store (runtime/sent_marks.py)


class OdinEngine(ActionHandlers, PhaseBoundary, WholeModel, ReadSetCheck, LaneDecisions):
    """Owns the distributed state of one rank and runs its training steps: plans each phase, runs the rank's
    program of the phase at the pipeline's seams (validate, render, publish), and the phase boundaries."""

    def __init__(self, env: DistEnv, model, datamanager, block_size: int, micro_batch: int, seed: int,
                 check_read_sets: bool = False, policy: str = "quality", phase_length: int = 25,
                 view_order: str = "odin", block_cut: str = "kd", max_staleness: int = 1,
                 admit_overlap: float = 1.0, admit_update: float = 0.0, lane: str = "auto",
                 projection_memory: str = "auto", projection_budget_mb: Optional[float] = None):
        self.env = env
        self.policy = POLICIES[policy]
        # reads may be behind (alone, every policy is plain training: nothing to be behind of)
        self.staleness = max_staleness if self.policy.stale_reads and env.distributed else 0
        self.admit_overlap = admit_overlap if self.staleness else 0.0
        self.admit_update = admit_update
        # throughput-first: where its communication lane runs (runtime/lane.py)
        self.lane_mode = resolve_lane(lane, torch.device(model.device).type)
        # what an owner holds of its projections until its update (runtime/splat_path.py)
        self.projection_memory = ProjectionMemory(keep_budget(projection_memory, projection_budget_mb,
                                                              device_memory(torch.device(model.device)),
                                                              env.world_size))
        # inline lanes' probe: each rank's last step whose gradients it sent (runtime/sent_marks.py), made by every
        # rank at start-up (the start-up's collectives come before the first probe); none where no ranks really run
        # (a schedule's preview) and for the exact policies (no lane)
        self._sent = (SentMarks(dist.distributed_c10d._get_default_store(), env.rank, env.world_size, SENT_KEY)
                      if env.distributed and dist.is_initialized() and self.lane_mode == "inline"
                      and self.policy.stale_reads else None)
        self.lane: Lane | None = None  # throughput-first: the phase's communication lane
        self.recorder = [] if os.environ.get(RECORD_ENV) else None  # every phase's program, when recording
        self.block_cut = block_cut
        # where phases end (the trainer sets the end, the checkpoints and, on several ranks, its collectives on
        # the default group, viewer refreshes and evaluations: `PhaseRules.of_trainer`; each ends its phase)
        self.rules = PhaseRules.of_model(model, phase_length)
        self.plan: PhasePlan | None = None
        self.plans_made = 0
        self.fault = FaultInjection.from_environment()
        self.ops = OpCounter.from_environment()  # odin-bench scale: the runtime's operations and syncs per step
        self.model = model
        self.datamanager = datamanager
        self.seed = seed
        self.check_read_sets = check_read_sets
        self.schedule_step = 0
        self.device = torch.device(model.device)
        self.log = WaitLog(env.rank)
        self.micro_batch = micro_batch
        # load (and undistort) the training images now: undistortion rewrites the cameras' intrinsics in place,
        # and read sets must be computed with the cameras the views are rendered with
        datamanager.cached_train  # noqa: B018 (a cached property: the access is the work)
        self.num_rest = num_sh_bases(model.config.sh_degree) - 1
        self.block_size = block_size
        self.param_names = PARAM_NAMES
        self._projections: Dict[Tuple[int, int], Tuple] = {}
        initial_means = self._shard_initial_model(block_size)
        # every training camera's projection now (set-up, whatever the order): the first plan of training would
        # otherwise pay for it, seconds on the first views, and count it as a phase wait
        downscale = model._get_downscale_factor()
        views = len(datamanager.train_dataset)
        for v in range(views):
            self._projection(v, downscale)
        self.schedule = view_schedule(
            view_order, lambda: view_read_masks(self.table, lambda v: self._projection(v, downscale), views),
            self.table.count, views, env.world_size, micro_batch, datamanager.config.train_cameras_sampling_seed,
            lambda: visible_gaussians(initial_means, self.table.count,
                                      [self._projection(v, downscale) for v in range(views)]))
        self.planner = PhasePlanner(env.world_size, micro_batch, self.schedule,
                                    lambda v: self._projection(v, model._get_downscale_factor()),
                                    self.policy.program_at(self.staleness).name, self.staleness, self.admit_overlap)
        model.engine = self

    # ---- set-up ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _shard_initial_model(self, block_size: int) -> torch.Tensor:
        """Cut the (identical on every rank) initial model into blocks (k-d leaves or Morton runs) and keep this
        rank's share; returns the whole model's means in block order (the view order's costs are made from them)."""
        params = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        mine, order = self._shard_full(params, block_size)
        for n, value in mine.items():
            self.model.gauss_params[n] = torch.nn.Parameter(value)
        self.sharded = ShardedGaussians(self.env, self.table, self.num_rest, self.device, self.log)
        self._new_runner()
        return params["means"][order]

    def _shard_full(self, full: Dict[str, torch.Tensor], block_size: int,
                    counts: Sequence[int] | None = None) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """Lay the whole model out in blocks, assign owners, build the table; this rank's rows of every
        tensor in `full` (parameters, or anything else with one row per Gaussian), in block order, and the order
        of every row (block order). With `counts` (a checkpoint's blocks: `full` is in block order) the blocks are
        those runs of rows instead of a new cut. Of the tensors in `full` only this rank's rows are copied (a
        checkpoint's whole model may be a file mapped into memory; the cut reads the means and scales)."""
        order, self.table = cut_blocks(full["means"], torch.exp(full["scales"]), block_size, self.block_cut,
                                       self.env.world_size, counts)
        block_of = torch.repeat_interleave(torch.arange(self.table.num_blocks), self.table.count)
        rows = order[(self.table.owner[block_of] == self.env.rank).to(order.device)]
        return {n: t[rows].contiguous() for n, t in full.items()}, order

    def _new_runner(self) -> None:
        self.width = self.sharded.width
        if self.env.distributed and dist.is_initialized() and getattr(self, "p2p_group", None) is None:
            # collective: every rank makes it at start-up, in the same order (a preview, odin-schedule, has no
            # process group and never sends)
            self.p2p_group = channels_group(self.env.timeout_s)
        self.runtime = RankRuntime(self.env, self.log, self.device, self.model, self.num_rest,
                                   admit_update=self.admit_update, p2p_group=getattr(self, "p2p_group", None))
        self.splats = SplatPath(self.runtime, self.model, self.num_rest, self._camera, self._owned_rows, self.ops,
                                memory=self.projection_memory)
        self.runtime.splats = self.splats
        self.plan = None

    # ---- phases ---------------------------------------------------------------------------------------------

    def _plan_phase(self, start: int, optimizers, done: int | None = None) -> Tuple[PhasePlan, float]:
        """The phase that starts at `start`: read sets from the synced table's bounds inflated, step by step, by
        the motion the optimizer can make since the phase started (`schedule.phase_planner`); on several ranks
        each tests its own views and the ranks all-gather the read sets. (The plan, the seconds the all-gather
        took: waiting for the other ranks, not this rank's planning.)"""
        stop = self.rules.stop(start)
        motion, growth = motion_bounds(optimizers, self.model.gauss_params, stop - start, done)
        share = None
        gathered = [0.0]
        if self.env.distributed:
            ranks = self.env.world_size

            def gather(rows: torch.Tensor) -> List[torch.Tensor]:
                started = time.perf_counter()
                try:
                    return all_gather_rows(rows, [rows.shape[0]] * ranks, self.log, "phase", kind="plan")
                finally:
                    gathered[0] += time.perf_counter() - started
            share = (self.env.rank, gather)
        return self.planner.plan(start, stop, self.table, motion, growth, share), gathered[0]

    def _begin_phase(self, step: int, optimizers) -> float:
        """Plan the phase (the runtime and the splat path set up for it); `_start_program` starts it once the
        phase-start state is projected for its first reads. The seconds the read sets' all-gather took."""
        self.plan, gather_s = self._plan_phase(step, optimizers)
        self.plan.prepare(self.env.rank)  # what the steps ask of the plan, listed here (planning, not step work)
        self.plans_made += 1
        envelope = (self.table.lo.clone(), self.table.hi.clone(), self.table.max_scale.clone())
        self.runtime.begin(self.plan, self.table, envelope)
        self.splats.begin(self.plan, self.table, self.runtime.home_start)
        return gather_s

    def _start_program(self, step: int) -> None:
        """The phase's program: the phase-start publications go out with the first step's waits."""
        me = self.env.rank
        self.program = Program(self.plan.actions(me), me, self.plan.start, self.plan.stop)
        if self.recorder is not None:
            self.recorder.append([self.plan.start, [f"{a.step}: {a!r}" for a in self.program.actions]])
        self.lane = self._new_lane(step) if self.staleness and self.env.distributed else None

    def _end_phase(self, step: int, optimizers) -> None:
        """A global synchronization point: every send taken, the table synced, then any structural change."""
        if self.lane is not None:
            with self._lane_waiting("phase"):
                self.lane.join()
            self.lane = None
        with self.log.waiting("phase"):
            self.runtime.finish()
            if self.rules.is_refine_step(step):
                self._refine(step, optimizers)
            else:
                self._sync_table()
        self.plan = None

    def dump_program(self, folder) -> None:
        """When recording (ODIN_NS_RECORD_MESSAGES): this rank's programs and every message it sent or received,
        in posting order, as odin_messages_rank{r}.json (the test that the lists are what ran)."""
        if self.recorder is None or self.runtime.channels is None:
            return
        path = folder / f"odin_messages_rank{self.env.rank}.json"
        path.write_text(json.dumps({"programs": self.recorder, "messages": self.runtime.channels.record}))

    def _owned_rows(self, rows: torch.Tensor) -> Dict[str, torch.Tensor]:
        return gathered_rows(self.model.gauss_params, rows)

    def _camera(self, step: int, view: int) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
        """A training view's camera at the resolution step `step` renders with: (viewmat [4, 4], K [3, 3], W, H)."""
        viewmat, K, W, H = self._projection(view, self.model.downscale_at(step))
        return viewmat[0].to(self.device), K[0].to(self.device), W, H

    # ---- one step: the seams run the step's part of the program ------------------------------------------------

    def _projection(self, view: int, downscale: int):
        """`view_projection` of a training camera, memoized (cameras do not move: no camera optimization)."""
        key = (view, downscale)
        if key not in self._projections:
            cameras = self.datamanager.train_dataset.cameras
            self._projections[key] = view_projection(cameras[view:view + 1], downscale)
        return self._projections[key]

    def _background(self, step: int, slot: int) -> torch.Tensor:
        """The random training background of one view: seeded by (seed, step, global slot), not by the rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * self.schedule.global_batch + slot)
        return torch.rand(3, generator=g).to(self.device)

    def validate(self, step: int, optimizers) -> List[int]:
        """Before the step: plan the phase if one starts here, then the program's actions before the renders:
        wait for (only) the publications the rank's views of `step` read, at the version the policy requires (the
        synchronous reference's for the exact policies). Returns the views."""
        self.fault.raise_at(step, self.env.rank)
        record = self.log.begin(step)
        if self.plan is None or not self.plan.contains(step):
            record.phase_start = True
            with self.ops.paused():  # a phase's planning is not a step's work
                with self.log.waiting("phase"):
                    started = time.perf_counter()
                    gather_s = self._begin_phase(step, optimizers)
                    record.plan_s = time.perf_counter() - started - gather_s
                # the phase-start state projected for the reads that take it (render work, as every projection
                # an owner makes for its readers: throughput-first's reach a step further than the exact ones')
                self.splats.project_update(step - 1)
                self._start_program(step)
        views = self.plan.rank_views(step, self.env.rank)
        record.views = list(views)
        self._ctx = StepContext(step, optimizers)
        if self.lane is not None:
            with self._lane_waiting("validate"):
                self.lane.ready(step)
        else:
            self.program.run(self.program.pre[step], self.handlers, self._ctx)
        self.runtime.attach_notes(step, record)
        return views

    def render(self, step: int, views: Sequence[int]):
        """Render each view from every owner's splats of it (this rank projected its own) and back-propagate to
        them; a view's gradients leave before the next view renders (the program's `between`; throughput-first's
        lane once the view is rendered). (loss, loss dict, metrics dict, per-view block ids)."""
        me, model = self.env.rank, self.model
        record = self.log.current
        view_ids = []
        loss = loss_dict = metrics_dict = None
        for j, view in enumerate(views):
            _, _, width, height = self._camera(step, view)
            self.splats.await_view(step, j)  # its splats from the other owners (the next view's may still travel)
            with self.log.computing():
                splats, radii, routing = self.splats.view_splats(step, j)
                view_ids.append(self.plan.view_reads(step, me)[j] + self.runtime.extras_self.get(step, {}).get(j, []))
                model.training_background = self._background(step, me * self.schedule.micro_batch + j)
                camera, batch = self.datamanager.train_view(view)
                outputs = model.outputs_from_splats(splats, radii, width, height, camera)
                metrics_dict = model.get_metrics_dict(outputs, batch)
                loss_dict = model.get_loss_dict(outputs, batch, metrics_dict)
                loss = functools.reduce(torch.add, loss_dict.values())
                loss.backward()
                record.loss += float(loss.detach()) / len(views)
                self.splats.after_backward(step, j, routing, model.splat_means2d)
            if self.lane is not None:
                with self.ops.counting(step):
                    self.lane.rendered(self._ctx, j)
            elif j + 1 < len(views):
                with self.ops.counting(step):
                    self.program.run(self.program.between[step][j], self.handlers, self._ctx)
        record.blocks_read = len({b for ids in view_ids for b in ids})
        return loss, loss_dict, metrics_dict, view_ids

    def publish(self, step: int, view_ids, optimizers) -> None:
        """After rendering: the program's actions that follow the renders: the splats' gradients to their owners,
        the owners' update in reference order, the next reads' splats to the ranks that render them, the barrier
        (odin-barrier); throughput-first hands the step to its lane. Then a phase's end."""
        plan, runtime, record = self.plan, self.runtime, self.log.current
        self._ctx.view_ids = list(view_ids)
        if self.check_read_sets:
            record.read_set_misses = self._count_misses(step)
        if self.lane is not None:
            self.lane.put(self._ctx)
        else:
            self.program.run(self.program.post[step], self.handlers, self._ctx)
        if step + 1 == plan.stop:
            with self.ops.paused():  # a phase boundary is not a step's work
                self._end_phase(step, optimizers)
        record.gaussians_owned = int(self.model.gauss_params["means"].shape[0])
        record.row_bytes = 4 * self.width
        record.message_bytes = self.log.held.take_peak()
        # no rank holds another's rows
        record.resident_bytes = 3 * record.row_bytes * record.gaussians_owned + record.message_bytes
        record.projection_bytes = self.splats.take_kept_peak()
        record.projections_kept, record.projections_again = self.projection_memory.take_counts()
        record.blocks_total = self.table.num_blocks
        record.misses_handled, runtime.misses_handled = runtime.misses_handled, 0
        record.plan_violations, runtime.plan_violations = runtime.plan_violations, 0
        self.log.end_inside()
