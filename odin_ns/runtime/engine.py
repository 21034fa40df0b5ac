"""The engine of one rank: the synchronous reference of DESIGN.md, run on sharded Gaussians, phase by phase.

At a phase's start every rank derives the same `PhasePlan` from replicated data (the views of every rank at every
step, their read sets from the block table's bounds inflated by the optimizer's largest motion, in one batched
test) and takes its own program of the phase from the policy registry (`schedule.policies`). The pipeline's
seams run the program step by step (`runtime.interpreter`): `validate` the actions before the step's renders
(the owners' splats in), `render` its views, `publish` what follows (the splats' gradients out, the owners' update,
the next reads' splats out, odin-barrier's barrier); throughput-first runs its communication on a lane beside the
renders (`runtime.lane`). What travels is splats (`runtime.splat_path`); the state the handlers share is
`runtime.rank_runtime`, reads behind are `runtime.admission`; phase boundaries (densify, prune, cut, rebalance,
the table's sync) are `runtime.boundary`. The result does not depend on how many ranks
share the global batch: N ranks with one view each equal one rank with a micro-batch of N views, bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from nerfstudio.cameras.cameras import Cameras
from nerfstudio.models.splatfacto import num_sh_bases
from nerfstudio.utils.rich_utils import CONSOLE

from odin_ns.render.projection import project
from odin_ns.render.viewmat import get_viewmat
from odin_ns.runtime.block_table import BlockTable
from odin_ns.runtime.boundary import PhaseBoundary
from odin_ns.runtime.dist_env import DistEnv
from odin_ns.runtime.fault_injection import FaultInjection
from odin_ns.runtime.interpreter import Program
from odin_ns.runtime.lane import Lane, resolve_lane
from odin_ns.runtime.op_count import OpCounter
from odin_ns.runtime.rank_runtime import RankRuntime
from odin_ns.runtime.splat_path import SplatPath
from odin_ns.runtime.sharded import PARAM_NAMES, ShardedGaussians, pack_params, packed_rows, unpack_params
from odin_ns.runtime.transport import RECORD_ENV
from odin_ns.runtime.waits import WaitLog
from odin_ns.scene.block_refine import STATE_KEYS
from odin_ns.scene.blocks import block_bounds, build_layout
from odin_ns.scene.ownership import assign_contiguous
from odin_ns.scene.read_sets import blocks_in_view, blocks_in_views, tight_step_bound
from odin_ns.schedule.odin_order import OdinSchedule, odin_schedule
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.policies import POLICIES
from odin_ns.schedule.views import ViewSchedule

SENT_KEY = "odin/lane/gradients-sent/"  # + rank: the last step whose gradients the rank sent (inline lanes)
NEAR_PLANE = 0.01  # the model's near plane (splatfacto's)


def view_projection(camera: Cameras, downscale: int) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """(viewmat [1,4,4] OpenCV world-to-camera, K [1,3,3], W, H) of one camera at the model's render resolution."""
    cam = camera.to("cpu")
    cam = Cameras(camera_to_worlds=cam.camera_to_worlds.clone(), fx=cam.fx.clone(), fy=cam.fy.clone(),
                  cx=cam.cx.clone(), cy=cam.cy.clone(), width=cam.width.clone(), height=cam.height.clone(),
                  camera_type=cam.camera_type.clone())
    cam.rescale_output_resolution(1 / downscale)
    width, height = int(cam.width.item()), int(cam.height.item())
    return get_viewmat(cam.camera_to_worlds), cam.get_intrinsics_matrices(), width, height


class OdinEngine(PhaseBoundary):
    """Owns the distributed state of one rank and runs its training steps: plans each phase, runs the rank's
    program of the phase at the pipeline's seams (validate, render, publish), and the phase boundaries."""

    def __init__(self, env: DistEnv, model, datamanager, block_size: int, micro_batch: int, seed: int,
                 check_read_sets: bool = False, policy: str = "quality", phase_length: int = 25,
                 view_order: str = "odin", block_cut: str = "kd", max_staleness: int = 1,
                 admit_overlap: float = 1.0, admit_update: float = 0.0, lane: str = "auto"):
        self.env = env
        self.policy = POLICIES[policy]
        # reads may be behind (alone, every policy is plain training: nothing to be behind of)
        self.staleness = max_staleness if self.policy.stale_reads and env.distributed else 0
        self.admit_overlap = admit_overlap if self.staleness else 0.0
        self.admit_update = admit_update
        # throughput-first: where its communication lane runs (runtime/lane.py)
        self.lane_mode = resolve_lane(lane, torch.device(model.device).type)
        # the job's key-value store (inline lanes' probe); none where no ranks really run (a schedule's preview)
        self._store = (dist.distributed_c10d._get_default_store() if env.distributed and dist.is_initialized()
                       else None)
        if self._store is not None and self.lane_mode == "inline":  # every key exists before the first probe (the
            self._store.set(f"{SENT_KEY}{env.rank}", "-1")  # start-up's collectives come between): one read each
        self.lane: Lane | None = None  # throughput-first: the phase's communication lane
        self.own_version: Dict[int, int] = {}  # throughput-first: the version of its own blocks each step renders
        self.recorder = [] if os.environ.get(RECORD_ENV) else None  # every phase's program, when recording
        self.save_every = 0  # the trainer's checkpoint interval: a checkpoint step ends its phase
        self.block_cut = block_cut
        self.phase_length = phase_length
        self.end_step: int | None = None  # the trainer sets it: no phase plans messages past the last step
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
        self.schedule = ViewSchedule(num_views=len(datamanager.train_dataset), num_ranks=env.world_size,
                                     micro_batch=micro_batch,
                                     seed=datamanager.config.train_cameras_sampling_seed)
        self.micro_batch = micro_batch
        # load (and undistort) the training images now: undistortion rewrites the cameras' intrinsics in place,
        # and read sets must be computed with the cameras the views are rendered with
        datamanager.cached_train  # noqa: B018 (a cached property: the access is the work)
        self.num_rest = num_sh_bases(model.config.sh_degree) - 1
        self.block_size = block_size
        self.param_names = PARAM_NAMES
        self._projections: Dict[Tuple[int, int], Tuple] = {}
        self._shard_initial_model(block_size)
        # every training camera's projection now (set-up, whatever the order): the first plan of training would
        # otherwise pay for it, seconds on the first views, and count it as a phase wait
        downscale = model._get_downscale_factor()
        for v in range(len(datamanager.train_dataset)):
            self._projection(v, downscale)
        if view_order == "odin":
            self.schedule = self._odin_schedule(micro_batch, datamanager.config.train_cameras_sampling_seed)
        elif view_order != "random":
            raise ValueError(f"unknown view order {view_order!r} (odin or random)")
        model.engine = self

    def _odin_schedule(self, micro_batch: int, seed: int) -> OdinSchedule:
        """Odin's order from the initial model: each view's read set (blocks) and cost (Gaussians it reads)."""
        downscale = self.model._get_downscale_factor()
        table = self.table
        masks = []
        for v in range(len(self.datamanager.train_dataset)):
            viewmat, K, W, H = self._projection(v, downscale)
            masks.append(blocks_in_view(table.lo, table.hi, viewmat, K, W, H, near=NEAR_PLANE,
                                        max_scale=table.max_scale)[0])
        return odin_schedule(torch.stack(masks), table.count, self.env.world_size, micro_batch, seed)

    # ---- set-up ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _shard_initial_model(self, block_size: int) -> None:
        """Cut the (identical on every rank) initial model into blocks (k-d leaves or Morton runs) and keep this rank's share."""
        params = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        for n, value in self._shard_full(params, block_size).items():
            self.model.gauss_params[n] = torch.nn.Parameter(value)
        self.sharded = ShardedGaussians(self.env, self.table, self.num_rest, self.device, self.log)
        self._new_runner()

    def _shard_full(self, full: Dict[str, torch.Tensor], block_size: int,
                    counts: Sequence[int] | None = None) -> Dict[str, torch.Tensor]:
        """Lay the whole model out in blocks, assign owners, build the table; this rank's rows of every
        tensor in `full` (parameters, or anything else with one row per Gaussian). With `counts` (a checkpoint's
        blocks: `full` is in block order) the blocks are those runs of rows instead of a new cut."""
        if counts is not None:
            order = torch.arange(full["means"].shape[0], device=full["means"].device)
            counts = torch.as_tensor(list(counts), dtype=torch.int64)
        else:
            layout = build_layout(full["means"], torch.exp(full["scales"]), block_size=block_size, cut=self.block_cut)
            order, counts = layout.order.to(full["means"].device), layout.counts.clone()
        ordered = {n: p[order] for n, p in full.items()}
        ownership = assign_contiguous(counts.numpy().astype(float), self.env.world_size)
        owner = torch.as_tensor(ownership.owner, dtype=torch.int64)
        block_of = torch.repeat_interleave(torch.arange(len(counts)), counts)
        lo, hi, _, _, max_scale = block_bounds(ordered["means"], torch.exp(ordered["scales"]), block_of, len(counts))
        self.table = BlockTable(owner=owner, count=counts, lo=lo, hi=hi, max_scale=max_scale,
                                version=torch.zeros(len(counts), dtype=torch.int64))
        mine = (owner[block_of] == self.env.rank).to(full["means"].device)
        return {n: t[mine].contiguous() for n, t in ordered.items()}

    @torch.no_grad()
    def adopt_full_model(self, moments: Dict[str, Dict[str, torch.Tensor]], optimizers,
                         resume: Dict | None = None) -> None:
        """After a checkpoint loaded the whole model into every rank: re-shard it (any rank count) with its moments.

        `moments[name]` holds "exp_avg"/"exp_avg_sq" of the whole model and "step" (one number). `resume` is what
        an odin checkpoint adds (`resume_state`): its blocks, kept as they were (so a resumed run renders the
        same rows in the same order as one that never stopped), gsplat's densification statistics and
        throughput-first's evidence; without it (a plain splatfacto checkpoint) the model is cut afresh."""
        full = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        n_rows = full["means"].shape[0]
        for n in PARAM_NAMES:
            for key in ("exp_avg", "exp_avg_sq"):
                full[f"{key}:{n}"] = moments.get(n, {}).get(key, torch.zeros_like(full[n]))
        resume = resume or {}
        counts = resume.get("blocks")
        if counts is not None and (sum(counts) != n_rows or max(counts, default=0) > self.block_size):
            counts = None  # another model, or a smaller --pipeline.block-size: cut afresh
        strategy = resume.get("strategy", {}) if counts is not None else {}
        for k, v in strategy.items():
            full[f"state:{k}"] = v.to(full["means"].device)
        mine = self._shard_full(full, self.block_size, counts)
        for n in PARAM_NAMES:
            optimizers.optimizers[n].state.clear()  # keyed by the Parameters the checkpoint load replaced
            self._replace_param(n, mine[n], {k: mine[f"{k}:{n}"] for k in ("exp_avg", "exp_avg_sq")}, optimizers)
            step = moments.get(n, {}).get("step")
            if step is not None:
                optimizers.optimizers[n].state[self.model.gauss_params[n]]["step"] = torch.as_tensor(
                    step, dtype=torch.float32).clone()
        for k in STATE_KEYS:
            self.model.strategy_state[k] = mine.get(f"state:{k}")
        self.sharded = ShardedGaussians(self.env, self.table, self.num_rest, self.device, self.log)
        self._new_runner()
        evidence = resume.get("evidence") if counts is not None else None
        if evidence is not None and self.staleness:
            self.runtime.rel_now = torch.as_tensor(evidence, dtype=torch.float64).clone()
            self.runtime._structural = False

    def resume_state(self) -> Dict | None:
        """What a resumed run needs beyond nerfstudio's checkpoint to go on as if it never stopped (collective; rank
        0 gets it, None elsewhere): the block of every row (as counts, rows in block order), gsplat's densification
        statistics since the last refine, and throughput-first's evidence (each block's last update size)."""
        state = self.model.strategy_state
        n = self.model.gauss_params["means"].shape[0]
        columns = [state[k].reshape(n, 1).float() if isinstance(state.get(k), torch.Tensor) and state[k].shape[0] == n
                   else torch.zeros((n, 1), device=self.device) for k in STATE_KEYS]
        rows = torch.cat(columns, dim=1)
        full = self.sharded.gather_to(0, rows) if self.env.distributed else rows
        evidence = None
        if self.staleness:
            mine = {int(b): float(self.runtime.rel_now[b]) for b in self.table.owned(self.env.rank)}
            every = [None] * self.env.world_size
            dist.all_gather_object(every, mine)
            evidence = torch.full((self.table.num_blocks,), math.inf, dtype=torch.float64)
            for part in every:
                for b, value in part.items():
                    evidence[b] = value
        if self.env.rank != 0:
            return None
        return {"blocks": self.table.count.tolist(),
                "strategy": {k: full[:, i].clone().cpu() for i, k in enumerate(STATE_KEYS)},
                "evidence": evidence}

    def _new_runner(self) -> None:
        self.width = self.sharded.width
        if self.env.distributed and dist.is_initialized() and getattr(self, "p2p_group", None) is None:
            # collective: every rank makes it at start-up, in the same order (a preview, odin-schedule, has no
            # process group and never sends)
            self.p2p_group = dist.new_group()
        self.runtime = RankRuntime(self.env, self.log, self.device, self.model, self.num_rest,
                                   admit_update=self.admit_update, p2p_group=getattr(self, "p2p_group", None))
        self.splats = SplatPath(self.runtime, self.model, self.num_rest, self._camera, self._owned_rows, self.ops)
        self.runtime.splats = self.splats
        self.plan = None

    # ---- phases ---------------------------------------------------------------------------------------------

    def _is_refine_step(self, step: int) -> bool:
        """gsplat's DefaultStrategy schedule: grow/prune every refine_every, opacity reset every reset_every."""
        st = self.model.strategy
        if step >= st.refine_stop_iter:
            return False
        grow = (step > st.refine_start_iter and step % st.refine_every == 0
                and step % st.reset_every >= st.pause_refine_after_reset)
        return grow or step % st.reset_every == 0

    def _sh_degree_changes_at(self, step: int) -> bool:
        """Splatfacto renders with SH degree min(step // sh_degree_interval, sh_degree)."""
        interval, degree = self.model.config.sh_degree_interval, self.model.config.sh_degree
        return interval > 0 and step % interval == 0 and 0 < step // interval <= degree

    def _phase_stop(self, start: int) -> int:
        """First step after the phase that starts at `start`: a refine step ends its phase, and so does a
        checkpoint step (every update applied before it is saved), the end of training and the phase length (a
        longer phase inflates its read sets by a larger motion bound); an SH degree change starts a phase. So no
        read is ever behind across a structural change."""
        stop = start + max(1, self.phase_length)
        if self.end_step is not None:
            stop = min(stop, max(self.end_step, start + 1))
        for s in range(start, stop):
            if s > start and self._sh_degree_changes_at(s):
                return s
            if self._is_refine_step(s) or (self.save_every and s > 0 and s % self.save_every == 0):
                return s + 1
        return stop

    def _step_bound(self, name: str, optimizers, updates: int, done: int | None = None) -> float:
        """Rigorous bound on how much one element of `name` can change in the next `updates` selective-Adam steps
        (`done`: Adam steps already taken, read from the optimizer unless given, as a preview without training
        does)."""
        opt = optimizers.optimizers[name]
        group = opt.param_groups[0]
        lr = max(float(group["lr"]), float(group.get("initial_lr", group["lr"])))
        state = opt.state.get(self.model.gauss_params[name], {})
        t = done if done is not None else (int(state["step"].item()) if "step" in state else 0)
        return sum(tight_step_bound(lr, group["betas"], t + 1 + i, group.get("bias_correction", True))
                   for i in range(updates))

    def _plan_phase(self, start: int, optimizers, done: int | None = None) -> PhasePlan:
        """Every rank derives the same plan: views from the schedule, read sets from the synced table's bounds
        inflated, step by step, by the motion the optimizer can make since the phase started. The read sets of
        every view of the phase come from one batched test (`blocks_in_views`); computing the other ranks' is
        cheaper than exchanging them. The plan keeps them as a tensor too (`read_mask[i, q, j, b]`)."""
        stop = self._phase_stop(start)
        downscale = self.model._get_downscale_factor()
        table = self.table
        views = [self.schedule.global_views(step) for step in range(start, stop)]
        motion = [math.sqrt(3.0) * self._step_bound("means", optimizers, i, done) for i in range(stop - start)]
        growth = [self._step_bound("scales", optimizers, i, done) for i in range(stop - start)]
        R, mb = self.env.world_size, self.schedule.micro_batch
        flat = [(i, v) for i, step_views in enumerate(views) for rank_views in step_views for v in rank_views]
        projections = [self._projection(v, downscale) for _, v in flat]
        mask = blocks_in_views(table.lo, table.hi, torch.cat([p[0] for p in projections]),
                               torch.cat([p[1] for p in projections]), torch.tensor([p[2] for p in projections]),
                               torch.tensor([p[3] for p in projections]), table.max_scale,
                               torch.tensor([motion[i] for i, _ in flat]), torch.tensor([growth[i] for i, _ in flat]),
                               near=NEAR_PLANE)
        mask &= (table.count > 0)[None, :]
        read_mask = mask.view(stop - start, R, mb, -1)
        hits = torch.nonzero(mask)
        per_view = torch.bincount(hits[:, 0], minlength=len(flat)).tolist()
        ids = hits[:, 1].tolist()
        reads, k, at = [], 0, 0
        for i in range(stop - start):
            per_step = []
            for q in range(R):
                per_rank = []
                for _ in range(mb):
                    per_rank.append(ids[at:at + per_view[k]])
                    at += per_view[k]
                    k += 1
                per_step.append(per_rank)
            reads.append(per_step)
        plan = PhasePlan(start=start, stop=stop, num_ranks=R, owner=table.owner.tolist(), views=views, reads=reads,
                         policy_name=self.policy.program_at(self.staleness).name, motion=motion, growth=growth,
                         staleness=self.staleness,
                         admit_overlap=self.admit_overlap, counts=table.count.tolist())
        plan.read_mask = read_mask
        return plan

    def _begin_phase(self, step: int, optimizers) -> None:
        """Plan the phase, start its program: the phase-start publications go out with the first step's waits."""
        self.plan = self._plan_phase(step, optimizers)
        self.plans_made += 1
        me = self.env.rank
        envelope = (self.table.lo.clone(), self.table.hi.clone(), self.table.max_scale.clone())
        self.runtime.begin(self.plan, self.table, envelope)
        self.splats.begin(self.plan, self.table, self.runtime.home_start)
        self.splats.project_update(step - 1, timed=False)  # the phase-start state's projections (its set-up)
        self.program = Program(self.plan.actions(me), me, self.plan.start, self.plan.stop)
        if self.recorder is not None:
            self.recorder.append([self.plan.start, [f"{a.step}: {a!r}" for a in self.program.actions]])
        self.lane = None
        if self.staleness and self.env.distributed:
            self.own_version = {}
            self.own_pos = step - 1
            self.lane = Lane(self.program, {"W": self._lane_wait, "G": self._lane_gradients, "U": self._lane_update,
                                            "P": self._lane_publish, "probe": self._lane_probe},
                             name=f"odin-lane-r{me}", mode=self.lane_mode)

    def _end_phase(self, step: int, optimizers) -> None:
        """A global synchronization point: every send taken, the table synced, then any structural change."""
        if self.lane is not None:
            with self._lane_waiting("phase"):
                self.lane.join()
            self.lane = None
        with self.log.waiting("phase"):
            self.runtime.finish()
            if self._is_refine_step(step):
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

    def _owned_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.model.gauss_params, rows)

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

    def _handlers(self, step: int, optimizers) -> Dict:
        splats = self.splats
        return {"P": lambda group: splats.publish(group[0].step, [a.peer for a in group]),
                "W": lambda group: self.runtime.take_current(step, [a.peer for a in group]),
                "G": lambda group: splats.send_gradients(step, [a.peer for a in group]),
                "U": lambda group: self._apply_update(step, optimizers),
                "B": lambda group: self.runtime.barrier()}

    def validate(self, step: int, optimizers) -> List[int]:
        """Before the step: plan the phase if one starts here, then the program's actions before the renders:
        wait for (only) the publications the rank's views of `step` read, at the version the policy requires (the
        synchronous reference's for the exact policies). Returns the views."""
        record = self.log.begin(step)
        if self.plan is None or not self.plan.contains(step):
            record.phase_start = True
            with self.log.waiting("phase"), self.ops.paused():  # a phase's planning is not a step's work
                self._begin_phase(step, optimizers)
        self.optimizers = optimizers
        views = self.plan.rank_views(step, self.env.rank)
        record.views = list(views)
        self._step_views = None
        if self.lane is not None:
            with self._lane_waiting("validate"):
                self.lane.ready(step)
        else:
            self.program.run(self.program.pre[step], self._handlers(step, optimizers))
        self.runtime.attach_notes(step, record)
        return views

    def render(self, step: int, views: Sequence[int]):
        """Render each view from every owner's splats of it (this rank projected its own) and back-propagate to
        them. (loss, loss dict, metrics dict, per-view block ids)."""
        me, model = self.env.rank, self.model
        record = self.log.current
        view_ids = []
        loss = loss_dict = metrics_dict = None
        for j, view in enumerate(views):
            _, _, width, height = self._camera(step, view)
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
        record.blocks_read = len({b for ids in view_ids for b in ids})
        return loss, loss_dict, metrics_dict, view_ids

    def publish(self, step: int, view_ids, optimizers) -> None:
        """After rendering: the program's actions that follow the renders: the splats' gradients to their owners,
        the owners' update in reference order, the next reads' splats to the ranks that render them, the barrier
        (odin-barrier); throughput-first hands the step to its lane. Then a phase's end."""
        plan, runtime, record = self.plan, self.runtime, self.log.current
        self._step_views = list(view_ids)
        if self.check_read_sets:
            record.read_set_misses = self._count_misses(step)
        if self.lane is not None:
            self.lane.put(step, [], self._step_views)
        else:
            self.program.run(self.program.post[step], self._handlers(step, optimizers))
            runtime.forget_step(step)
            self.splats.forget_step(step)
        if step + 1 == plan.stop:
            with self.ops.paused():  # a phase boundary is not a step's work
                self._end_phase(step, optimizers)
        record.gaussians_owned = int(self.model.gauss_params["means"].shape[0])
        record.row_bytes = 4 * self.width
        record.resident_bytes = 3 * record.row_bytes * record.gaussians_owned + record.bytes_sent + \
            record.bytes_received  # no rank holds another's rows
        record.blocks_total = self.table.num_blocks
        record.misses_handled, runtime.misses_handled = runtime.misses_handled, 0
        record.plan_violations, runtime.plan_violations = runtime.plan_violations, 0
        self.log.end_inside()

    # ---- the handlers' work ---------------------------------------------------------------------------------

    def _apply_update(self, step: int, optimizers) -> None:
        """U: the owners' update of `step` (the views' splat gradients back through the projections, every
        contribution in reference order, selective Adam on the touched rows), its learning-rate step, the check of
        the moved rows for the next step's reads, then every read that takes this version projected."""
        runtime, plan = self.runtime, self.plan
        track = step < self.model.strategy.refine_stop_iter
        readers = plan.readers(step, self.env.rank)
        if plan.staleness and runtime.channels is not None:
            runtime.drain(step, readers)  # publications ahead of the gradients on a pair
        runtime.apply(step, self.splats.contributions(step, readers), optimizers, track)
        optimizers.scheduler_step_all(step)
        if plan.contains(step + 1):
            params = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
            self.fault.apply(self, step, params)
            runtime.check_envelope(step + 1, self._visible)
            self.splats.project_update(step)

    # throughput-first: the lane's handlers (the communication thread)

    def _lane_wait(self, action, until: int) -> bool:
        step, me = action.step, self.env.rank
        if action.peer != me:
            return self.runtime.take_admitted(step, action.peer, until)
        version = self.runtime.own_admitted(step, self.own_pos, until)
        if version is None:
            return False
        self.own_pos = self.own_version[step] = version
        self.splats.check_read(step, me, version)
        return True

    def _lane_waiting(self, cause: str):
        """Around a call into the lane: on a thread, the rank waits for it (`cause`); inline, the lane runs on the
        rank's thread and its own waits, update and packing count as what they are."""
        return self.log.waiting(cause) if self.lane_mode == "thread" else contextlib.nullcontext()

    def _lane_gradients(self, group, contributions, view_ids) -> None:
        self.splats.send_gradients(group[0].step, [a.peer for a in group])
        if self.lane_mode == "inline":  # the owners' probe: this rank's gradients of the step are out
            self._store.set(f"{SENT_KEY}{self.env.rank}", str(group[0].step))

    def _lane_probe(self, action) -> bool:
        """Inline: whether every reader of the rank's blocks at `action.step` has sent its gradients of that step
        (each rank notes, in the job's key-value store, the last step whose gradients it sent; the gradients are
        on the pair after every earlier message, so the update would not wait). Which way it goes changes when the
        update runs, never what it computes nor what any render reads."""
        keys = [f"{SENT_KEY}{q}" for q in self.plan.readers(action.step, self.env.rank)]
        return not keys or all(int(v) >= action.step for v in self._store.multi_get(keys))

    def _lane_update(self, action, given) -> None:
        self._apply_update(action.step, self.optimizers)
        self.runtime.forget_step(action.step)
        self.splats.forget_step(action.step)

    def _lane_publish(self, group) -> None:
        self.splats.publish(group[0].step, [a.peer for a in group])

    def _visible(self, view: int, rows: Dict[str, torch.Tensor]) -> int:
        """How many of these Gaussians gsplat's projection keeps (radius > 0) in training view `view`."""
        if rows["means"].shape[0] == 0:
            return 0
        viewmat, K, W, H = self._projection(view, self.model._get_downscale_factor())
        dev = rows["means"].device
        radii = project(rows["means"], rows["quats"], torch.exp(rows["scales"]), None, viewmat.to(dev), K.to(dev),
                        W, H, 0.3, NEAR_PLANE, 1e10, 0.0, False)[0]
        return int((radii > 0).sum())

    @torch.no_grad()
    def _count_misses(self, step: int) -> int:
        """DESIGN.md semantics 6, verified by the owners (`--pipeline.check-read-sets`): Gaussians of this rank's
        blocks that some view of the step keeps although their block was not in what that view rendered.

        The parameters are those the views of `step` rendered (before this step's update). Read sets are
        conservative by construction and the runtime adds a block to a read set when an update takes it outside
        its planned bounds, so this is zero; a miss is reported on the console and counted in odin_stats.json
        (`read_set_misses`), never ignored."""
        ranges = self.table.owned_ranges(self.env.rank)
        if not ranges:
            return 0
        params = {n: t.detach() for n, t in self.model.gauss_params.items() if n in PARAM_NAMES}
        misses = 0
        extras = self.runtime.extras_out.get(step, {})
        for q, views in enumerate(self.plan.views[self.plan.index(step)]):
            for j, view in enumerate(views):
                seen = set(self.plan.view_reads(step, q)[j])
                if q == self.env.rank:
                    seen |= set(self._step_views[j])
                seen |= {b for jj, b in extras.get(q, []) if jj == j}
                outside = sorted(set(ranges) - seen)
                if not outside:
                    continue
                rows = torch.cat([torch.arange(*ranges[b]) for b in outside]).to(params["means"].device)
                found = self._visible(view, {n: t[rows] for n, t in params.items()})
                if found:
                    CONSOLE.log(f"[bold red]odin: rank {self.env.rank}: {found} Gaussians visible from view {view} "
                                f"(rank {q}) lie outside its read set[/bold red]")
                misses += found
        return misses

    # ---- the whole model on rank 0 ---------------------------------------------------------------------------
    def gather_full(self) -> Dict[str, torch.Tensor] | None:
        """Every block's parameters on rank 0 in block order (collective); None elsewhere."""
        owned_rows = pack_params({n: self.model.gauss_params[n] for n in PARAM_NAMES})
        if not self.env.distributed:
            return {n: t.clone() for n, t in unpack_params(owned_rows, self.num_rest).items()}
        rows = self.sharded.gather_to(0, owned_rows)
        if rows is None:
            return None
        return {n: t.contiguous() for n, t in unpack_params(rows, self.num_rest).items()}

    def gather_optimizer_states(self, optimizers) -> Dict[str, Dict[str, torch.Tensor]] | None:
        """The Adam moments of every Gaussian on rank 0, in block order (collective); None elsewhere."""
        gathered: Dict[str, Dict[str, torch.Tensor]] = {n: {} for n in PARAM_NAMES}
        for key in ("exp_avg", "exp_avg_sq"):
            owned = {}
            for n in PARAM_NAMES:
                param = self.model.gauss_params[n]
                owned[n] = optimizers.optimizers[n].state.get(param, {}).get(key, torch.zeros_like(param))
            rows = pack_params(owned)
            full = self.sharded.gather_to(0, rows) if self.env.distributed else rows
            if full is None:
                continue
            for n, t in unpack_params(full, self.num_rest).items():
                gathered[n][key] = t.contiguous()
        return gathered if self.env.rank == 0 else None

