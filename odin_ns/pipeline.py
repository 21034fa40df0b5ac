"""The nerfstudio Pipeline seam: a VanillaPipeline that never wraps the model in DDP.

DDP cannot follow densification (the parameter set changes size), so Odin keeps the model bare and moves
primitive state itself around each step: `OdinPipeline.train_step` is the hook the trainer calls, validate before
the model renders, publish after. Alone (one rank) this pipeline is nerfstudio's VanillaPipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Literal, Optional, Tuple, Type

import torch
from torch.cuda.amp.grad_scaler import GradScaler

from nerfstudio.pipelines.base_pipeline import Pipeline, VanillaPipeline, VanillaPipelineConfig

from odin_ns.datamanager import OdinDataManagerConfig
from odin_ns.errors import OdinInputError
from odin_ns.model import OdinModelConfig
from odin_ns.recipe import RecipeUnits
from odin_ns.runtime.dist_env import init_distributed
from odin_ns.runtime.engine import OdinEngine
from odin_ns.schedule.policies import POLICIES
from odin_ns.viewer_panel import attach as attach_panel

PolicyName = Literal[tuple(POLICIES)]  # the registry's names (tyro lists them as the choices)


@dataclass
class OdinPipelineConfig(VanillaPipelineConfig):
    """VanillaPipeline's options with the odin datamanager and model."""

    _target: Type = field(default_factory=lambda: OdinPipeline)
    datamanager: OdinDataManagerConfig = field(default_factory=OdinDataManagerConfig)
    model: OdinModelConfig = field(default_factory=OdinModelConfig)
    policy: PolicyName = "quality"
    """Synchronization across ranks: a policy of the registry (odin_ns/schedule/policies.py): quality-first (odin),
    throughput-first, or a global barrier every step; each method (odin, odin-throughput, odin-barrier) sets it."""
    block_size: int = 512
    """Most Gaussians per block: the unit of ownership, versioning and transfer."""
    block_cut: Literal["kd", "morton"] = "kd"
    """How blocks are cut: leaves of a balanced k-d split of the means (compact bounds, so a view reads few blocks)
    or runs of Morton order (runs that cross a large octree cell span much of the scene)."""
    micro_batch: int = 1
    """Views per rank per step; the global batch of a step is ranks x micro_batch views."""
    recipe: RecipeUnits = "views"
    """What the training's step-valued settings count. views: training views, as splatfacto's one-view steps do;
    with B = ranks x micro_batch views a step the trainer divides them by B and scales the optimizer by Grendel-GS's
    sqrt rule (learning rates x sqrt(B), Adam eps / sqrt(B), betas ** B), so one command line trains the same
    views on any rank count, and a resumed run ends where it would have. steps: nerfstudio's steps, unscaled."""
    dist_timeout_s: float = 120.0
    """Seconds a rank waits on its peers before it gives up (a dead or mismatched rank)."""
    view_order: Literal["odin", "random"] = "odin"
    """Which rank renders which view when: Odin's schedule (concurrent views share few blocks, ranks balanced by
    cost) or nerfstudio's seeded random order cut into global batches. Every policy runs on either."""
    phase_length: int = 25
    """Most steps between two planning points (refine steps end a phase too). Read sets of a phase are inflated by
    the optimizer's largest motion over it: longer phases synchronize less often but read more blocks."""
    max_staleness: int = 1
    """Throughput-first: the most versions a read may be behind (1: it may miss the previous step's update of a
    block, never an older one). More hides more of the ranks' imbalance and lets more updates be missed; 0 makes
    odin-throughput odin. The other policies ignore it."""
    admit_overlap: float = 1.0
    """Throughput-first, the schedule's admission test: a read may be behind only if at most this share of the
    view's Gaussians (counted by block) lie in the owner's blocks the pending steps update. 1 admits any overlap
    (the evidence decides); 0 admits only reads of blocks the pending steps leave unchanged (exact: odin's result)."""
    admit_update: float = 0.05
    """Throughput-first, the runtime's evidence: a read k versions behind is admitted only if k times the relative
    size ||delta|| / ||params|| of the last update of each block it reads is at most this. Smaller refuses more
    reads (waits more, closer to odin); larger admits reads behind larger updates (hides more, drifts more)."""
    lane: Literal["auto", "inline", "thread"] = "auto"
    """Throughput-first: where the communication lane (gradients out, publications in, the owner's update and its
    publications) runs: inline, on the rank's own thread when it would otherwise wait (it renders its next step
    while a peer's gradients are late, and updates after that render; nothing competes with the renders for a
    core), or on a thread beside the renders (the update is published while the next render runs). auto: inline
    on CPU ranks, a thread on GPUs. Every choice gives the same model bit for bit."""
    projection_memory: Literal["auto", "keep", "recompute"] = "auto"
    """What an owner holds of its projections for its readers between publishing their splats and its update:
    keep (the projection's graph: about three times the projected rows' parameters, more than the owned rows with
    their moments when every view reads most of them) or recompute (the splats only; the update projects again with a
    graph, from the current rows, or from a copy of the rows a throughput-first read behind took). auto: keep while
    the kept graphs hold about --pipeline.projection-budget-mb at most and recompute beyond (small scenes at keep's
    speed, large ones at recompute's memory); unset, the budget is a quarter of the GPU's memory on several GPUs,
    and no bound (every graph kept) on one GPU (plain training's cost) and on CPU ranks (the projection is about a
    third of a render there). Every choice gives the same model bit for bit."""
    projection_budget_mb: Optional[float] = None
    """--pipeline.projection-memory auto: about the most MB an owner's kept projection graphs hold (on any device;
    unset: a quarter of the GPU's memory on several GPUs, no bound on one GPU and on CPU ranks)."""
    check_read_sets: bool = False
    """Owners also verify, every step, by projecting every Gaussian of every block a view did not read, that none
    is visible (counted as read_set_misses; costly: for tests and debugging)."""
    viewer_refresh_every: int = 50
    """Steps between refreshes of the copy of the model the live viewer shows when training on several ranks."""
    viewer_max_gaussians: int = 0
    """The most Gaussians of the model the live viewer's copy on rank 0 holds when training on several ranks:
    above it each rank sends its most opaque ones, its share by its share of the model (the viewer's Odin panel
    says how many it shows). 0: as many as a sixteenth of a GPU's memory holds in rows (a refresh holds about
    four copies at its peak), no bound on CPU ranks."""
    seed: int = 42
    """Seed of the initial model and of per-view randomness (the odin trainer sets it from --machine.seed)."""

    def __post_init__(self) -> None:
        check_options(self)  # when the flags are parsed: before any rank starts or anything is written


def check_options(config: OdinPipelineConfig) -> None:
    """Odin's options in range, or one line that says which is not (and what it means)."""
    if config.block_size < 1:
        raise OdinInputError(f"--pipeline.block-size is the most Gaussians per block and must be at least 1 "
                             f"(got {config.block_size}; the default is 512)")
    if config.micro_batch < 1:
        raise OdinInputError(f"--pipeline.micro-batch is the views per rank per step and must be at least 1 "
                             f"(got {config.micro_batch})")
    if config.phase_length < 1:
        raise OdinInputError(f"--pipeline.phase-length must be at least 1 step (got {config.phase_length})")
    if not config.dist_timeout_s > 0:
        raise OdinInputError(f"--pipeline.dist-timeout-s must be more than 0 seconds (got {config.dist_timeout_s})")
    if config.viewer_refresh_every < 1:
        raise OdinInputError(f"--pipeline.viewer-refresh-every must be at least 1 step "
                             f"(got {config.viewer_refresh_every})")
    if config.viewer_max_gaussians < 0:
        raise OdinInputError(f"--pipeline.viewer-max-gaussians must be 0 (a sixteenth of a GPU) or more "
                             f"(got {config.viewer_max_gaussians})")
    if config.max_staleness < 0:
        raise OdinInputError(f"--pipeline.max-staleness must be 0 or more (got {config.max_staleness})")
    if not 0.0 <= config.admit_overlap <= 1.0:
        raise OdinInputError(f"--pipeline.admit-overlap is a share of a view's Gaussians, in [0, 1] "
                             f"(got {config.admit_overlap})")
    if config.projection_budget_mb is not None and not config.projection_budget_mb >= 0.0:
        raise OdinInputError(f"--pipeline.projection-budget-mb must be 0 or more (got {config.projection_budget_mb})")
    if config.projection_budget_mb is not None and config.projection_memory != "auto":
        which = "every" if config.projection_memory == "keep" else "no"
        raise OdinInputError(f"--pipeline.projection-budget-mb is auto's budget; --pipeline.projection-memory "
                             f"{config.projection_memory} keeps {which} graph (leave one of the two out)")
    if not config.admit_update >= 0.0:  # also refuses nan
        raise OdinInputError(f"--pipeline.admit-update must be 0 or more (got {config.admit_update})")


def setup_model(config: OdinPipelineConfig, datamanager, device, grad_scaler: Optional[GradScaler] = None):
    """The model, seeded from the dataset's points, identical on every rank (nerfstudio seeds by rank)."""
    metadata = getattr(datamanager, "train_dataparser_outputs", None)
    metadata = metadata.metadata if metadata is not None else {}
    seed_points = None
    if "points3D_xyz" in metadata:
        seed_points = (metadata["points3D_xyz"], metadata["points3D_rgb"])
    datamanager.to(device)
    torch.manual_seed(config.seed)
    return config.model.setup(
        scene_box=datamanager.train_dataset.scene_box,
        num_train_data=len(datamanager.train_dataset),
        metadata=datamanager.train_dataset.metadata,
        device=device,
        grad_scaler=grad_scaler,
        seed_points=seed_points,
    )


class OdinPipeline(VanillaPipeline):
    """VanillaPipeline without DDP: the datamanager, then the model seeded from the dataset's points."""

    config: OdinPipelineConfig

    def __init__(
        self,
        config: OdinPipelineConfig,
        device: str,
        test_mode: Literal["test", "val", "inference"] = "val",
        world_size: int = 1,
        local_rank: int = 0,
        grad_scaler: Optional[GradScaler] = None,
    ):
        Pipeline.__init__(self)
        self.config = config
        self.test_mode = test_mode
        self.world_size = world_size
        self.datamanager = config.datamanager.setup(
            device=device, test_mode=test_mode, world_size=world_size, local_rank=local_rank
        )
        self._model = setup_model(config, self.datamanager, device, grad_scaler)
        self.model.to(device)
        self.engine = None
        if test_mode == "val":  # training (nerfstudio's evaluation tools construct pipelines in test/inference)
            env = init_distributed(device.split(":")[0] if isinstance(device, str) else device.type,
                                   config.dist_timeout_s)
            self.engine = OdinEngine(env, self.model, self.datamanager, config.block_size, config.micro_batch,
                                     config.seed, config.check_read_sets, policy=config.policy,
                                     phase_length=config.phase_length, view_order=config.view_order,
                                     block_cut=config.block_cut, max_staleness=config.max_staleness,
                                     admit_overlap=config.admit_overlap, admit_update=config.admit_update,
                                     lane=config.lane, projection_memory=config.projection_memory,
                                     projection_budget_mb=config.projection_budget_mb)
            if env.distributed and env.rank == 0:  # the viewer's Odin panel (rank 0 serves the viewer)
                attach_panel(self, env.world_size, config.policy, self._colour_by_owner)
        self.viewer_model = None  # rank 0 of several: the viewer's copy of the model (see OdinModel.show_snapshot)
        self._owner_colours = False  # the panel's toggle; only the viewer's copy draws in owner colours

    def show_snapshot(self, snapshot, owners):
        """Rank 0 of several: the gathered copy of the model (`runtime.viewer_snapshot`: the whole model, or its most
        opaque Gaussians within the viewer's bound) and each row's owner is what the viewer draws now."""
        view = self.model.show_snapshot(snapshot, owners)
        view.colour_by_owner = self._owner_colours
        self.__dict__["viewer_model"] = view  # not a sub-module: the pipeline's state dict stays the model's

    def _colour_by_owner(self, on: bool) -> None:
        """The panel's toggle (viewer thread): the next frames, and every later snapshot, in owner colours."""
        self._owner_colours = on
        if self.viewer_model is not None:
            self.viewer_model.colour_by_owner = on

    def train_step(self, step: int, optimizers) -> Tuple[torch.Tensor, Dict, Dict]:
        """The hook the trainer calls once per training step, around the model's forward and backward:
        validate (wait for exactly the blocks this rank's views read, at the version the synchronous reference
        reads), render (the model on those blocks' splats), publish (the splats' gradients to the owners, the
        owners' update, the next reads' splats to the ranks that render them). (loss, loss dict, metrics dict) of
        the rank's last view."""
        engine = self.engine
        with engine.ops.counting(step):
            views = engine.validate(step, optimizers)
        loss, loss_dict, metrics_dict, blocks = engine.render(step, views)
        record = engine.log.current
        with engine.ops.counting(step):
            engine.publish(step, blocks, optimizers)
        if engine.ops.active(step):
            counts = engine.ops.take()
            record.runtime_ops, record.runtime_syncs = counts["ops"], counts["syncs"]
        return loss, loss_dict, metrics_dict
