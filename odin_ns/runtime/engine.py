"""One training step across ranks: the synchronous reference of DESIGN.md, run on sharded Gaussians.

Step t, on every rank r (one rank is the same with no peers):
1. plan: every rank's views of step t (the schedule) and their read sets (blocks whose bounds meet the view's
   frustum, from the replicated block table), the same on every rank;
2. fetch (validate): owners send the remote blocks each reader lacks at their current version;
3. compute: render each of this rank's views from its read set, loss, backward into per-view leaves;
4. transfer (publish gradients): each view's gradients and densification statistics go to the blocks' owners;
5. update: owners sum contributions in (rank, view) order, apply selective Adam to the Gaussians some view of the
   step touched, bump those blocks' versions and bounds;
6. barrier: the owners' table rows are all-gathered (the global synchronization of `odin-barrier`);
7. phase boundary (refine steps): owners densify/prune their blocks (`scene.block_refine`), the table is synced.
The result does not depend on how many ranks share the global batch: N ranks with one view each equal one rank
with a micro-batch of N views, parameter for parameter.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from nerfstudio.cameras.cameras import Cameras
from nerfstudio.models.splatfacto import num_sh_bases
from nerfstudio.utils.rich_utils import CONSOLE

from odin_ns.render.projection import project
from odin_ns.render.viewmat import get_viewmat
from odin_ns.runtime.block_table import BlockTable, shard_bounds
from odin_ns.runtime.fault_injection import FaultInjection
from odin_ns.runtime.op_count import OpCounter
from odin_ns.runtime.phase_runner import PhaseRunner
from odin_ns.runtime.dist_env import DistEnv
from odin_ns.runtime.sharded import (GRAD_EXTRA, PARAM_NAMES, ShardedGaussians, pack_params, param_columns,
                                     unpack_params)
from odin_ns.runtime.rebuild import cut_rows, global_cube, morton_within, new_ownership, piece_sizes, plan_rebuild
from odin_ns.runtime.transport import exchange
from odin_ns.runtime.update_worker import UpdateWorker
from odin_ns.runtime.waits import WaitLog
from odin_ns.scene.block_refine import STATE_KEYS, refine_blocks
from odin_ns.scene.blocks import block_bounds, build_layout
from odin_ns.scene.kd_split import kd_order
from odin_ns.scene.ownership import assign_contiguous
from odin_ns.scene.read_sets import blocks_in_view, tight_step_bound
from odin_ns.schedule.odin_order import OdinSchedule
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.views import ViewSchedule

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


class OdinEngine:
    """Owns the distributed state of one rank and runs its training steps."""

    def __init__(self, env: DistEnv, model, datamanager, block_size: int, micro_batch: int, seed: int,
                 check_read_sets: bool = False, policy: str = "quality", phase_length: int = 25,
                 view_order: str = "odin", block_cut: str = "kd", max_staleness: int = 1,
                 admit_overlap: float = 1.0, admit_update: float = 0.0):
        self.env = env
        # throughput-first reads may be behind (alone, every policy is plain training: nothing to be behind of)
        self.staleness = max_staleness if policy == "throughput" and env.distributed else 0
        self.admit_overlap = admit_overlap if self.staleness else 0.0
        self.admit_update = admit_update
        self.own_current = True  # does this step's read of the rank's own blocks see every update
        self.own_rows: torch.Tensor | None = None  # the owned rows this step renders (throughput-first)
        self.own_version = -1  # the update those rows are the result of
        self.worker: UpdateWorker | None = None
        if self.staleness:  # owner updates beside the render (see runtime.update_worker)
            self.worker = UpdateWorker(self._update_step, self._owned_rows)
        self.save_every = 0  # the trainer's checkpoint interval: a checkpoint step ends its phase
        self.block_cut = block_cut
        self.policy = policy
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
        table, blocks, costs, affinity = self.table, [], [], []
        slots = self.env.world_size * micro_batch
        # the share of each global slot: a contiguous cut per slot, independent of how slots are split into ranks
        share = torch.as_tensor(assign_contiguous(table.count.numpy().astype(float), slots).owner)
        for v in range(len(self.datamanager.train_dataset)):
            viewmat, K, W, H = self._projection(v, downscale)
            mask = blocks_in_view(table.lo, table.hi, viewmat, K, W, H, near=NEAR_PLANE,
                                  max_scale=table.max_scale)[0] & (table.count > 0)
            blocks.append(frozenset(torch.nonzero(mask).flatten().tolist()))
            costs.append(float(table.count[mask].sum()))
            per_slot = torch.zeros(slots).index_add_(0, share[mask], table.count[mask].double().float())
            affinity.append(per_slot.tolist())
        return OdinSchedule(num_views=len(blocks), num_ranks=self.env.world_size, micro_batch=micro_batch,
                            seed=seed, view_blocks=blocks, costs=costs,
                            view_affinity=affinity if slots > 1 else ())

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
            self.runner.rel_now = torch.as_tensor(evidence, dtype=torch.float64).clone()
            self.runner._structural = False

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
            mine = {int(b): float(self.runner.rel_now[b]) for b in self.table.owned(self.env.rank)}
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
        self.runner = PhaseRunner(self.env, self.width, self.width + GRAD_EXTRA, self.device, self.log,
                                  list(param_columns(self.num_rest).values()), admit_update=self.admit_update)
        self.runner.reset(self.model.gauss_params["means"].shape[0])
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
        inflated, step by step, by the motion the optimizer can make since the phase started."""
        stop = self._phase_stop(start)
        downscale = self.model._get_downscale_factor()
        views, reads, motion, growth = [], [], [], []
        table = self.table
        for i, step in enumerate(range(start, stop)):
            m = math.sqrt(3.0) * self._step_bound("means", optimizers, i, done)
            g = self._step_bound("scales", optimizers, i, done)
            motion.append(m)
            growth.append(g)
            step_views = self.schedule.global_views(step)
            per_step = []
            for rank_views in step_views:
                per_rank = []
                for v in rank_views:
                    viewmat, K, W, H = self._projection(v, downscale)
                    mask = blocks_in_view(table.lo, table.hi, viewmat, K, W, H, near=NEAR_PLANE,
                                          max_scale=table.max_scale, motion=m, log_scale_growth=g)[0]
                    per_rank.append(torch.nonzero(mask & (table.count > 0)).flatten().tolist())
                per_step.append(per_rank)
            views.append(step_views)
            reads.append(per_step)
        return PhasePlan(start=start, stop=stop, num_ranks=self.env.world_size, owner=table.owner.tolist(),
                         views=views, reads=reads, barrier=self.policy == "barrier", motion=motion, growth=growth,
                         staleness=self.staleness, admit_overlap=self.admit_overlap, counts=table.count.tolist())

    def _begin_phase(self, step: int, optimizers) -> None:
        self.own_version = step - 1
        self.plan = self._plan_phase(step, optimizers)
        rows = self._owned_rows()
        if self.worker is not None:
            self.worker.begin(step - 1, rows)
        self.plans_made += 1
        self.runner.envelope = (self.table.lo.clone(), self.table.hi.clone(), self.table.max_scale.clone())
        self.runner.begin(self.plan, self.table, rows)

    def _end_phase(self, step: int, optimizers) -> None:
        """A global synchronization point: every send taken, the table synced, then any structural change."""
        with self.log.waiting("phase"):
            self.runner.finish()
            if self._is_refine_step(step):
                self._refine(step, optimizers)
            else:
                self._sync_table()
        self.plan = None

    def _owned_rows(self) -> torch.Tensor:
        return pack_params({n: self.model.gauss_params[n] for n in PARAM_NAMES})

    # ---- one step -------------------------------------------------------------------------------------------

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
        """Before the step: plan the phase if one starts here, then wait for (only) the publications the rank's
        views of `step` read, at the version the synchronous reference reads. Returns those views."""
        record = self.log.begin(step)
        self.schedule_step = step
        if self.plan is None or not self.plan.contains(step):
            record.phase_start = True
            with self.log.waiting("phase"):
                self._begin_phase(step, optimizers)
        views = self.plan.rank_views(step, self.env.rank)
        record.views = list(views)
        if self.worker is not None:  # the exact policies have applied every update by now
            self._choose_own_version(step)
        if self.env.distributed:
            self.runner.validate(step)
        return views

    def _choose_own_version(self, step: int) -> None:
        """Throughput-first: the version of its own blocks the rank renders at `step`, decided as a reader decides
        (from the plan and the evidence, never from how far the update thread has got), and its rows."""
        plan, runner, me = self.plan, self.runner, self.env.rank
        blocks = plan.publish_blocks(step, me, me)
        at = torch.tensor(blocks, dtype=torch.int64)
        p, tested = self.own_version, False
        with self.log.waiting("validate"):
            while p < step - 1:
                if plan.schedule_admits(step, me, me, step - 1 - p):
                    tested = True
                    self.worker.wait(p)
                    if runner.admits(step, me, me, p, runner.rel_hist[p][at]):
                        break
                p += 1
            self.own_rows = self.worker.rows(p)
        self.own_version = p
        self.own_current = p == step - 1
        runner.note_read(step, me, blocks, step - 1 - p, tested, runner.rel_hist[p][at])

    def _update_step(self, step: int, mine, view_ids, optimizers) -> torch.Tensor | None:
        """The owners' update of `step`, then its learning-rate step; the packed rows it published (on the update
        thread: the copy the render thread may read)."""
        rows = self._update_owners(step, mine, view_ids, optimizers)
        optimizers.scheduler_step_all(step)
        self.runner.forget_step(step)
        return rows

    def render(self, step: int, views: Sequence[int]):
        """Render each view from its read set (owned blocks and replicas) and back-propagate into per-view leaves;
        (loss, loss dict, metrics dict, per-view contributions, per-view block ids)."""
        me, model, runner = self.env.rank, self.model, self.runner
        record = self.log.current
        owned_rows = self.own_rows if self.own_rows is not None else self._owned_rows()
        self.own_rows = None
        view_ids = [runner.view_blocks(step, j, self.own_current) for j in range(len(views))]
        record.gaussians_replicated = runner.num_replicated()
        record.blocks_read = len({b for ids in view_ids for b in ids})
        mine: List[torch.Tensor] = []
        loss = loss_dict = metrics_dict = None
        for j, view in enumerate(views):
            rows = runner.render_rows(step, view_ids[j], owned_rows)
            with self.log.computing():
                leaves = {n: t.clone().requires_grad_() for n, t in unpack_params(rows, self.num_rest).items()}
                model.render_params = leaves
                model.training_background = self._background(step, me * self.schedule.micro_batch + j)
                camera, batch = self.datamanager.train_view(view)
                outputs = model(camera)
                metrics_dict = model.get_metrics_dict(outputs, batch)
                loss_dict = model.get_loss_dict(outputs, batch, metrics_dict)
                loss = functools.reduce(torch.add, loss_dict.values())
                loss.backward()
                record.loss += float(loss.detach()) / len(views)
            mine.append(self._contribution(leaves, model.info))
            model.render_params = None
        return loss, loss_dict, metrics_dict, mine, view_ids

    def publish(self, step: int, mine: Sequence[torch.Tensor], view_ids, optimizers) -> None:
        """After rendering: gradients to the blocks' owners, the owners' update in reference order (throughput-
        first: of the step max-staleness before, the later ones wait until a read needs them or the phase ends),
        the changed rows pushed to the ranks that read them next; odin-barrier's barrier; a phase's end."""
        plan, runner, record = self.plan, self.runner, self.log.current
        if self.env.distributed:
            runner.send_gradients(step, mine, view_ids)
        if self.check_read_sets:
            record.read_set_misses = self._count_misses(step)
        if self.worker is not None:
            self.worker.submit(step, list(mine), list(view_ids), optimizers)
            if step + 1 == plan.stop:
                with self.log.waiting("phase"):
                    self.worker.wait(step)
        else:
            self._update_step(step, mine, view_ids, optimizers)
        if self.policy == "barrier" and self.env.distributed:
            with self.log.waiting("barrier"):
                dist.barrier()
        if step + 1 == plan.stop:
            self._end_phase(step, optimizers)
        record.gaussians_owned = int(self.model.gauss_params["means"].shape[0])
        record.blocks_total = self.table.num_blocks
        record.misses_handled, runner.misses_handled = runner.misses_handled, 0
        record.plan_violations, runner.plan_violations = runner.plan_violations, 0
        self.log.end_inside()

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
        extras = self.runner.extras_out.get(step, {})
        for q, views in enumerate(self.plan.views[self.plan.index(step)]):
            for j, view in enumerate(views):
                seen = set(self.plan.view_reads(step, q)[j])
                if q == self.env.rank:
                    seen |= set(self.runner.view_blocks(step, j, self.own_current))
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

    def _contribution(self, leaves: Dict[str, torch.Tensor], info: Dict) -> torch.Tensor:
        """[M, D + 3] rows: the view's gradient of every Gaussian it rendered, and gsplat's densification stats."""
        m = leaves["means"].shape[0]
        grads = pack_params({n: (leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n]))
                             for n in PARAM_NAMES})
        means2d = info["means2d"]
        g2d = means2d.absgrad if self.model.strategy.absgrad else means2d.grad
        g2d = g2d.clone() if g2d is not None else torch.zeros_like(means2d)
        g2d[..., 0] *= info["width"] / 2.0 * info["n_cameras"]  # gsplat's DefaultStrategy._update_state
        g2d[..., 1] *= info["height"] / 2.0 * info["n_cameras"]
        radii = info["radii"][0]
        visible = radii > 0
        norm = torch.where(visible, g2d[0].norm(dim=-1), torch.zeros(m, device=g2d.device))
        scaled_radii = radii / float(max(info["width"], info["height"]))
        extra = torch.stack([norm, visible.to(norm.dtype), scaled_radii.to(norm.dtype)], dim=1)
        return torch.cat([grads, extra.to(grads.dtype)], dim=1)

    @torch.no_grad()
    def _update_owners(self, step: int, mine: Sequence[torch.Tensor], view_ids, optimizers) -> torch.Tensor | None:
        """Sum contributions in reference order, selective Adam on the touched rows, then publish for step+1;
        the packed owned rows published (None at the phase's last step)."""
        model = self.model
        width = self.width
        contributions = self.runner.collect(step, mine, view_ids)
        with self.log.updating():
            n_owned = model.gauss_params["means"].shape[0]
            dtype = mine[0].dtype if mine else torch.float32
            acc = torch.zeros((n_owned, width), dtype=dtype, device=self.device)
            touched = torch.zeros(n_owned, dtype=torch.bool, device=self.device)
            track = step < model.strategy.refine_stop_iter
            state = model.strategy_state
            if track:
                for k in STATE_KEYS:
                    if state.get(k) is None or state[k].shape[0] != n_owned:
                        state[k] = torch.zeros(n_owned, device=self.device)
            for idx, piece in contributions:
                acc[idx] += piece[:, :width]
                vis = piece[:, width + 1] > 0
                touched[idx] |= vis
                if track:
                    state["grad2d"][idx] += torch.where(vis, piece[:, width], torch.zeros_like(piece[:, width]))
                    state["count"][idx] += vis.to(state["count"].dtype)
                    state["radii"][idx] = torch.where(vis, torch.maximum(state["radii"][idx], piece[:, width + 2]),
                                                      state["radii"][idx])
            grads = unpack_params(acc, self.num_rest)
            rows = torch.nonzero(touched).flatten()
            changed = torch.zeros((n_owned, len(PARAM_NAMES)), dtype=torch.bool, device=self.device)
            # throughput-first: each block's relative update size, the evidence for admitting reads behind it
            delta_sq = torch.zeros(n_owned, dtype=torch.float64, device=self.device) if self.staleness else None
            for g, n in enumerate(PARAM_NAMES):
                param = model.gauss_params[n]
                param.grad = grads[n].reshape(param.shape).contiguous()
                opt = optimizers.optimizers[n]
                opt.visibility = touched
                before = param.detach()[rows] if self.env.distributed else None  # indexing copies
                opt.step()
                if before is not None:  # which parameters of which rows changed: only those are published
                    after = param.detach()[rows]
                    changed[rows, g] = (after != before).flatten(1).any(dim=1)
                    if delta_sq is not None:
                        delta_sq[rows] += (after - before).double().pow(2).flatten(1).sum(dim=1)
        self.runner.updated(step, changed, delta_sq)
        if self.plan.contains(step + 1):
            params = {n: model.gauss_params[n].detach() for n in PARAM_NAMES}
            self.fault.apply(self, step, params)
            self.runner.check_envelope(step + 1, params, self._visible)
            rows = self._owned_rows()
            self.runner.publish(step, rows)
            return rows
        return None

    def _sync_table(self) -> None:
        """Current sizes and bounds of this rank's blocks into the table, then the all-gather that spreads them."""
        me = self.env.rank
        ranges = self.table.owned_ranges(me)
        params = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        lo, hi, max_scale = shard_bounds(params, ranges)
        ids = sorted(ranges)
        counts = torch.tensor([ranges[b][1] - ranges[b][0] for b in ids], dtype=torch.int64)
        self.table.update_owned(me, counts, lo, hi, max_scale, torch.ones(len(ids), dtype=torch.bool))
        if self.env.distributed:
            self.table.sync(me, self.env.world_size, self.log, "phase")

    # ---- phase boundaries -----------------------------------------------------------------------------------

    def _refine(self, step: int, optimizers) -> None:
        """gsplat's DefaultStrategy schedule (grow/prune every refine_every, opacity reset), owners per block."""
        strategy, model = self.model.strategy, self.model
        if step >= strategy.refine_stop_iter:
            return
        grow = (step > strategy.refine_start_iter and step % strategy.refine_every == 0
                and step % strategy.reset_every >= strategy.pause_refine_after_reset)
        reset = step % strategy.reset_every == 0
        if not (grow or reset):
            return
        if grow:
            self._grow_and_prune(step, optimizers)
        if reset:
            self._reset_opacities(strategy.prune_opa * 2.0, optimizers)
        self._sync_table()
        if grow:
            self._rebuild_blocks(optimizers)
            self.runner.reset(model.gauss_params["means"].shape[0])
            if self.env.rank == 0:
                CONSOLE.log(f"Step {step}: {int(self.table.count.sum())} Gaussians in {self.table.num_blocks} blocks")
        else:
            self.runner.mark_all_dirty()

    def _grow_and_prune(self, step: int, optimizers) -> None:
        model, me = self.model, self.env.rank
        ranges = self.table.owned_ranges(me)
        triples = [(b, s, e) for b, (s, e) in sorted(ranges.items())]
        params = {n: model.gauss_params[n].detach() for n in PARAM_NAMES}
        opt_states = {n: dict(optimizers.optimizers[n].state.get(model.gauss_params[n], {})) for n in PARAM_NAMES}
        new_params, new_opt, new_state, counts, _ = refine_blocks(
            model.strategy, params, opt_states, model.strategy_state, triples, step, self.seed)
        for n in PARAM_NAMES:
            self._replace_param(n, new_params[n], new_opt[n], optimizers)
        model.strategy_state.update(new_state)
        ids = sorted(ranges)
        self.table.count[ids] = torch.tensor(counts, dtype=torch.int64)

    def _rebuild_blocks(self, optimizers) -> None:
        """Cut grown blocks, drop empty ones, rebalance and move blocks (see runtime.rebuild); then sync."""
        table, me, R = self.table, self.env.rank, self.env.world_size
        plan = plan_rebuild(table.count.numpy(), self.block_size)
        if not plan.changed:
            return
        owner = new_ownership(plan, table.owner.numpy(), R)
        cube = global_cube(table.lo, table.hi, table.count)
        ranges = table.owned_ranges(me)
        rows = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
        for key in ("exp_avg", "exp_avg_sq"):
            for n in PARAM_NAMES:
                st = optimizers.optimizers[n].state.get(self.model.gauss_params[n], {})
                rows[f"{key}:{n}"] = st.get(key, torch.zeros_like(rows[n]))
        for k, v in self.model.strategy_state.items():
            if isinstance(v, torch.Tensor) and v.shape[0] == rows["means"].shape[0]:
                rows[f"state:{k}"] = v
        # this rank's pieces of the new blocks, cut from the old blocks it owns
        held: Dict[int, Dict[str, torch.Tensor]] = {}
        new_id = 0
        for b, k in enumerate(plan.pieces.tolist()):
            if b in ranges and k:
                s0, s1 = ranges[b]
                block = {name: t[s0:s1] for name, t in rows.items()}
                sizes = piece_sizes(s1 - s0, k)
                if k == 1:
                    order = torch.arange(s1 - s0, device=block["means"].device)
                elif self.block_cut == "kd":
                    order = kd_order(block["means"], sizes).to(block["means"].device)
                else:
                    order = morton_within(block["means"], cube)
                for j, piece in enumerate(cut_rows(block, order, sizes)):
                    held[new_id + j] = piece
            new_id += k
        # blocks whose owner changes travel (values unchanged), then each rank keeps its own in id order
        names = sorted(rows)
        widths = {name: rows[name].flatten(1).shape[1] if rows[name].dim() > 1 else 1 for name in names}
        holder = table.owner.numpy()[plan.parent]
        sends, shapes, incoming = {}, {}, {}
        for j in range(len(plan.parent)):
            src, dst = int(holder[j]), int(owner[j])
            if src == dst:
                continue
            if src == me:
                packed = torch.cat([held[j][n].reshape(int(plan.sizes[j]), widths[n]).float() for n in names], dim=1)
                sends.setdefault(dst, []).append(packed)
                del held[j]
            elif dst == me:
                incoming.setdefault(src, []).append(j)
        total = sum(widths.values())
        for src, ids in incoming.items():
            shapes[src] = (int(plan.sizes[ids].sum()), total)
        received = exchange({d: torch.cat(v) for d, v in sends.items()}, shapes, torch.float32, self.device,
                            self.log, "phase")
        for src, ids in incoming.items():
            start = 0
            for j in ids:
                n = int(plan.sizes[j])
                chunk, col = received[src][start:start + n], 0
                held[j] = {}
                for name in names:
                    w = widths[name]
                    held[j][name] = chunk[:, col:col + w].reshape((n,) + tuple(rows[name].shape[1:])).to(
                        rows[name].dtype)
                    col += w
                start += n
        mine = [j for j in range(len(plan.parent)) if int(owner[j]) == me]
        joined = {name: (torch.cat([held[j][name] for j in mine]) if mine else rows[name][:0]) for name in names}
        for n in PARAM_NAMES:
            self._replace_param(n, joined[n], {key: joined[f"{key}:{n}"] for key in ("exp_avg", "exp_avg_sq")},
                                optimizers)
        for k in list(self.model.strategy_state):
            if f"state:{k}" in joined:
                self.model.strategy_state[k] = joined[f"state:{k}"]
        B = len(plan.parent)
        self.table = BlockTable(owner=torch.as_tensor(owner, dtype=torch.int64),
                                count=torch.as_tensor(plan.sizes, dtype=torch.int64),
                                lo=torch.zeros(B, 3), hi=torch.zeros(B, 3), max_scale=torch.zeros(B),
                                version=torch.zeros(B, dtype=torch.int64))
        self.sharded.table = self.table
        self._sync_table()

    def _reset_opacities(self, value: float, optimizers) -> None:
        """gsplat's `reset_opa`: clamp opacities, zero their moments (elementwise, so shard-independent)."""
        model = self.model
        p = model.gauss_params["opacities"]
        clamped = torch.clamp(p.detach(), max=torch.logit(torch.tensor(value)).item())
        state = optimizers.optimizers["opacities"].state.get(p, {})
        self._replace_param("opacities", clamped,
                            {k: torch.zeros_like(v) for k, v in state.items() if k != "step"}, optimizers)

    def _replace_param(self, name: str, value: torch.Tensor, opt_state: Dict[str, torch.Tensor], optimizers) -> None:
        """Swap a Gaussian parameter for a new tensor, moving its optimizer state along (as gsplat's ops do)."""
        model = self.model
        old = model.gauss_params[name]
        optimizer = optimizers.optimizers[name]
        state = optimizer.state.pop(old, {})
        new = torch.nn.Parameter(value.contiguous())
        for k, v in opt_state.items():
            state[k] = v
        optimizer.param_groups[0]["params"] = [new]
        optimizer.state[new] = state
        model.gauss_params[name] = new
        optimizers.parameters[name] = [new]

    # ---- the whole model on rank 0 --------------------------------------------------------------------------

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

