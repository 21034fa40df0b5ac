"""The nerfstudio Trainer seam: device choice and clear errors before any work starts.

nerfstudio defaults `--machine.device-type` to cuda; the odin methods default to CUDA when it is available and
the CPU otherwise, and a request for CUDA on a machine without it ends in one line instead of a CUDA traceback
deep inside the model.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Type

import torch
import torch.distributed as dist

from nerfstudio.engine.callbacks import TrainingCallbackLocation
from nerfstudio.engine.trainer import Trainer, TrainerConfig
from nerfstudio.utils import writer
from nerfstudio.utils.misc import step_check
from nerfstudio.utils.rich_utils import CONSOLE

from odin_ns.checkpoint import (check_same_recipe, check_same_scene, load_checkpoint_state, scene_identity,
                                unmapped, write_full_checkpoint)
from odin_ns.errors import OdinInputError
from odin_ns.pipeline import OdinPipeline
from odin_ns.recipe import apply_recipe, recipe_rows
from odin_ns.runtime.dist_env import init_distributed
from odin_ns.runtime.eval_splats import EvalSplats
from odin_ns.runtime.stats_file import write_stats
from odin_ns.runtime.stop_request import EXIT_INTERRUPTED, StopRequest
from odin_ns.runtime.viewer_snapshot import gather_for_viewer, viewer_limit
from odin_ns.schedule.phase_planner import eval_intervals
from odin_ns.viewer_panel import panel_of, window_shares


def default_device_type() -> str:
    """CUDA when this machine has it, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device_type: str) -> None:
    if device_type == "cuda" and not torch.cuda.is_available():
        raise OdinInputError("--machine.device-type cuda was given but this machine has no usable CUDA device "
                             "(leave the flag out to train on the CPU)")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise OdinInputError("--machine.device-type mps was given but MPS is not available here "
                             "(leave the flag out to train on the CPU)")


def check_viewer_port(config: TrainerConfig) -> None:
    """A viewer port given on the command line that another program holds: one line, before any work (viser
    would end in a traceback after the data is loaded). Without a port, nerfstudio finds a free one itself."""
    port = config.viewer.websocket_port
    if port is None or not config.is_viewer_enabled():
        return
    from odin_ns.cli.train import port_free

    if not port_free(port, config.viewer.websocket_host):
        raise OdinInputError(f"--viewer.websocket-port {port} is in use (choose another, or leave the flag out to get "
                             "a free one)")


@dataclass
class OdinTrainerConfig(TrainerConfig):
    """nerfstudio's TrainerConfig; `ns-train odin*` builds the odin trainer from it."""

    _target: Type = field(default_factory=lambda: OdinTrainer)


class OdinTrainer(Trainer):
    """nerfstudio's Trainer whose iterations are run by the odin engine, on one rank or several.

    nerfstudio's loop stays in charge of logging, evaluation, checkpoints and the viewer; what changes:
    - `train_iteration`: one step of the engine (render the rank's views, route gradients to owners, selective
      Adam, barrier, phase boundary);
    - checkpoints and the viewer need the whole model: every rank takes part in a gather to rank 0, which then
      writes a plain splatfacto checkpoint (put together in host memory, one rank's rows at a time) / refreshes
      what the viewer shows;
    - an evaluation runs on rank 0 and renders from every owner's splats, which the other ranks serve meanwhile
      (`runtime.eval_splats`): no rank holds the whole model for it.
    """

    pipeline: OdinPipeline

    def __init__(self, config: OdinTrainerConfig, local_rank: int = 0, world_size: int = 1) -> None:
        check_device(config.machine.device_type)
        config.pipeline.seed = config.machine.seed
        env = init_distributed(config.machine.device_type, config.pipeline.dist_timeout_s)
        if env.distributed:
            world_size = env.world_size
            if "LOCAL_RANK" in os.environ:  # torchrun; nerfstudio's own launcher passes local_rank itself
                local_rank = env.local_rank
            if env.backend == "nccl":
                torch.cuda.set_device(local_rank)  # collectives of Python objects use the current device
        if env.rank == 0:
            check_viewer_port(config)
        # the recipe counted in views (odin_ns/recipe.py): the trainer runs a copy in steps of ranks x micro-batch
        given = config
        config, self.recipe = apply_recipe(config, world_size if env.distributed else 1)
        self.recipe_changes = recipe_rows(given, config)
        self.recipe_length = config.max_num_iterations  # the recipe's last step + 1, resumed or not
        if env.rank == 0:
            CONSOLE.print(self.recipe.describe(given.max_num_iterations, config.max_num_iterations), soft_wrap=True)
        super().__init__(config, local_rank, world_size)
        self.env = env
        self.stop_request = StopRequest(env.rank)
        self._stopped_at: int | None = None  # the step after which every rank agreed to stop (Ctrl+C)
        self._window_start = 0  # the first step record of the viewer panel's current window

    @property
    def engine(self):
        return self.pipeline.engine

    def train(self) -> None:
        self.stop_request.install()
        # ranks start the first step together: set-up skew (one rank still caching its images) is not a wait of
        # training, and would otherwise land in the first phase boundary of whichever policy runs first. The
        # all-reduce of a stop request is that barrier (a Ctrl+C during set-up ends the job here)
        if self.stop_request.agreed(self.env.distributed, self.engine.device):
            self._say("odin: stopped before the first step (Ctrl+C): nothing trained, no checkpoint written")
            raise SystemExit(EXIT_INTERRUPTED)
        if self.recipe.units == "views":
            self._train_to_the_recipes_end()
        if self.env.distributed and self.config.is_viewer_enabled():
            self._refresh_viewer(self._start_step)  # the model it starts from, while no phase runs
        self._started = time.perf_counter()
        self.engine.rules.of_trainer(self.config, self._start_step, self.config.max_num_iterations,
                                     self.env.distributed)
        super().train()

    def _train_to_the_recipes_end(self) -> None:
        """A recipe counted in views ends at its last step whether or not the run resumed (nerfstudio's loop trains
        `max_num_iterations` more steps from wherever it starts; `--pipeline.recipe steps` keeps that)."""
        left = self.recipe_length - self._start_step
        if left <= 0:
            raise OdinInputError(
                f"the checkpoint resumed from is at step {self._start_step - 1}, and the recipe ends at step "
                f"{self.recipe_length - 1} ({self.recipe_length} steps of {self.recipe.batch} view(s)): nothing is "
                "left to train (a larger --max-num-iterations, counted in views, trains on)")
        self.config.max_num_iterations = left

    def _after_train(self) -> None:
        """nerfstudio's end of training, with the collective parts (checkpoint, stats) before rank 0 may block in
        the viewer's "training complete" loop; after an agreed Ctrl+C stop, the same collective parts at the step
        the ranks stopped after, then one line and exit 130 (no viewer loop)."""
        if self._stopped_at is not None:
            self.step = self._stopped_at  # nerfstudio's loop has moved on to the step it did not run
        self.training_state = "completed"
        self.engine.log.close()  # the last step ends here, before the final checkpoint's gather
        self.save_checkpoint(self.step)
        writer.write_out_storage()
        self.write_stats()
        if self._stopped_at is not None:
            self._say(f"odin: stopped after step {self.step} (Ctrl+C): checkpoint {self.checkpoint_dir}/"
                      f"step-{self.step:09d}.ckpt (resume: the same command with --load-dir {self.checkpoint_dir})")
            raise SystemExit(EXIT_INTERRUPTED)
        if self.env.rank != 0:
            return
        CONSOLE.print(f"[bold green]Training finished[/bold green]: config {self.config.get_base_dir() / 'config.yml'}"
                      f", checkpoints {self.checkpoint_dir}")
        for callback in self.callbacks:
            callback.run_callback_at_location(step=self.step, location=TrainingCallbackLocation.AFTER_TRAIN)
        if not self.config.viewer.quit_on_train_completion:
            self._train_complete_viewer()

    def _say(self, line: str) -> None:
        """One line on stderr for the job (rank 0's)."""
        if self.env.rank == 0:
            print(line, file=sys.stderr, flush=True)

    def _stop_agreed(self, step: int) -> bool:
        """At a phase end (a global synchronization point: the ranks agree on a stop there), or every step alone."""
        if self.env.distributed and self.engine.plan is not None:
            return False
        return self.stop_request.agreed(self.env.distributed, self.engine.device)

    def write_stats(self):
        """odin_stats.json beside the run's outputs (every rank takes part; rank 0 writes)."""
        meta = {"method": self.config.method_name, "policy": self.config.pipeline.policy,
                "micro_batch": self.config.pipeline.micro_batch, "block_size": self.config.pipeline.block_size,
                "recipe": {"units": self.recipe.units, "views_per_step": self.recipe.batch,
                           "eval_phase_steps": self.recipe.eval_floor,
                           "changed": [list(r) for r in self.recipe_changes]}}
        wall = time.perf_counter() - getattr(self, "_started", time.perf_counter())
        self.engine.dump_program(self.base_dir)
        return write_stats(self.engine.log, self.env.world_size, wall, self.base_dir, meta)

    def train_iteration(self, step: int):
        # no zero_grad_all: the Gaussians never get autograd gradients (views render copies), the owners' update
        # sets each one's gradient itself, and a throughput-first update may be running on its thread right now
        loss, loss_dict, metrics_dict = self.pipeline.train_step(step, self.optimizers)
        if self._stop_agreed(step):
            self._stopped_at, self.stop_training = step, True  # nerfstudio's loop ends before the next step
        refresh = self.config.pipeline.viewer_refresh_every
        if self.env.distributed and self.config.is_viewer_enabled() and step > 0 and step % refresh == 0:
            self._refresh_viewer(step)  # a step that ends its phase (`PhaseRules.of_trainer`): nothing in flight
        return loss.detach(), {k: v.detach() for k, v in loss_dict.items()}, metrics_dict

    def _refresh_viewer(self, step: int) -> None:
        """Collective, every viewer refresh: a copy of the model to rank 0, the whole model or its most opaque
        Gaussians within the viewer's bound (`runtime.viewer_snapshot`: what its viewer draws until the next one),
        and every rank's shares of the window since the last refresh (the Odin panel)."""
        engine = self.engine
        limit = viewer_limit(self.config.pipeline.viewer_max_gaussians, engine.device, engine.num_rest)
        snapshot, owners, shown, total = gather_for_viewer(engine, limit)
        records = self.engine.log.records
        window = [r.to_dict() for r in records[self._window_start:-1]]  # closed steps only
        self._window_start = max(0, len(records) - 1)
        shares = [None] * self.env.world_size
        dist.all_gather_object(shares, window_shares(window))
        if self.env.rank != 0:
            return
        first = self.pipeline.viewer_model is None
        self.pipeline.show_snapshot(snapshot, owners)
        if first and self.viewer_state is not None:
            # from now on the viewer renders its own copy of the model, beside the training steps: without the
            # trainer's lock, so that a frame on rank 0 never holds up a step (and with it the other ranks)
            self.viewer_state.get_model = lambda: self.pipeline.viewer_model
            self.viewer_state.train_lock = threading.Lock()
        panel = panel_of(self.pipeline)
        if panel is not None:
            plan = self.engine.plan
            phase = (f"phase {self.engine.plans_made}: steps {plan.start}-{plan.stop - 1}" if plan is not None
                     else f"phase {self.engine.plans_made} ended" if self.engine.plans_made else "not started")
            panel.show(step, phase, shares, shown, total)

    def _evaluates(self, step: int) -> bool:
        """An evaluation runs after this step (one that ends its phase: `PhaseRules.of_trainer`)."""
        return any(step_check(step, every) for every in eval_intervals(self.config))

    def eval_iteration(self, step: int) -> None:
        """nerfstudio's evaluation; on several ranks rank 0 runs it and every render in it is made from every
        owner's splats (`runtime.eval_splats`), which the other ranks serve meanwhile: no rank holds the whole
        model for it."""
        if not self.env.distributed:
            return super().eval_iteration(step)
        if not self._evaluates(step):
            return
        renders = EvalSplats(self.engine)
        if self.env.rank != 0:
            renders.serve()
            return
        model = self.pipeline.model
        model.eval_splats = renders.request
        try:
            super().eval_iteration(step)
        finally:
            model.eval_splats = None
            renders.stop()
        self.engine.log.current.eval_renders += renders.renders

    def _load_checkpoint(self) -> None:
        """nerfstudio's `--load-dir` / `--load-checkpoint`, for a checkpoint of the whole model on any rank count:
        every rank maps its file into memory, nerfstudio's load takes all but the Gaussians, and the engine puts the
        rank's own Gaussians with their Adam moments on its device."""
        found = load_checkpoint_state(self.config, say=self._say)
        if found is None:
            CONSOLE.print("No Nerfstudio checkpoint to load, so training from scratch.")
            return
        path, state = found
        check_same_scene(path, state.get("odin", {}).get("scene"), scene_identity(self))
        check_same_recipe(path, state.get("odin", {}).get("recipe"), self.recipe)
        self._start_step = state["step"] + 1
        # the whole model stays in host memory: nerfstudio's load takes none of its rows (splatfacto resizes its
        # Gaussians to the rows it is given) and the engine puts each rank's own rows on its device (a checkpoint
        # with splatfacto's older keys is loaded whole, as nerfstudio loads it)
        keys = {n: f"_model.gauss_params.{n}" for n in self.engine.param_names}
        full = {n: state["pipeline"][k] for n, k in keys.items()} if all(
            k in state["pipeline"] for k in keys.values()) else None
        for n, k in keys.items() if full is not None else ():
            state["pipeline"][k] = full[n][:0]
        self.pipeline.load_pipeline(state["pipeline"], state["step"])
        gaussian_groups = {}
        for group, opt_state in state["optimizers"].items():
            if group in self.engine.param_names:
                gaussian_groups[group] = opt_state["state"].get(0, {})
                # the group's hyper-parameters as they were (the scheduled learning rate of the step saved: the
                # scheduler sets the next one only after the next update)
                saved = (opt_state.get("param_groups") or [{}])[0]
                live = self.optimizers.optimizers[group].param_groups[0]
                live.update({k: v for k, v in saved.items() if k != "params" and k in live})
            elif group in self.optimizers.optimizers:  # (torch keeps the loaded state's tensors where it can)
                self.optimizers.optimizers[group].load_state_dict(unmapped(opt_state))
        self.engine.adopt_full_model(gaussian_groups, self.optimizers, state.get("odin", {}).get("resume"), full)
        if "schedulers" in state and self.config.load_scheduler:
            self.optimizers.load_schedulers(state["schedulers"])
        self.grad_scaler.load_state_dict(state["scalers"])
        CONSOLE.print(f"Done loading checkpoint from {path} ({self.env.world_size} rank(s))")

    def save_checkpoint(self, step: int) -> None:
        """Write a plain splatfacto checkpoint of the whole model on rank 0 (every rank takes part in the gather)."""
        full = self.engine.gather_full(to_host=True)  # in host memory (no device need hold the whole model)
        states = self.engine.gather_optimizer_states(self.optimizers, to_host=True)
        resume = self.engine.resume_state()
        if self.env.rank != 0:
            return
        write_full_checkpoint(self, step, full, states, resume)
