"""The nerfstudio model seam: splatfacto's Gaussian model, made to run on any device and render through Odin.

`OdinModel` is a `SplatfactoModel` (so `ns-export gaussian-splat`, `ns-viewer`, `ns-eval` and `ns-render` accept it
unchanged) with three differences from splatfacto:
- no hard-coded CUDA: tensors follow the model's device, and rendering goes through `odin_ns.render`
  (gsplat's kernels on CUDA, the PyTorch rasterizer elsewhere);
- no network at construction: LPIPS is measured only when its AlexNet weights are already on disk;
- a training view is rendered from splats (`outputs_from_splats`: the owners project their Gaussians, the view's
  rank rasterizes); `get_outputs` (evaluation, the viewer) renders the Gaussians of `gaussians_for_view`, or,
  on rank 0 of several evaluating, every owner's splats (`eval_splats`).
Training steps are run by `odin_ns.runtime.engine.OdinEngine` (sharding, selective Adam, block-wise densification).
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, Optional, Type, Union

import torch
import tyro

from nerfstudio.cameras.cameras import Cameras
from nerfstudio.engine.callbacks import TrainingCallback, TrainingCallbackLocation
from nerfstudio.models.splatfacto import (
    RGB2SH,
    SplatfactoModel,
    SplatfactoModelConfig,
    num_sh_bases,
    random_quat_tensor,
)
from nerfstudio.utils.rich_utils import CONSOLE

from odin_ns.image_metrics import PSNR
from odin_ns.recipe import length_in_steps
from odin_ns.render import rasterization
from odin_ns.render.projection import partition_free
from odin_ns.render.viewmat import get_viewmat

GAUSSIAN_PARAMS = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")


def owner_palette(num_ranks: int) -> torch.Tensor:
    """[num_ranks, 3] RGB in [0, 1], one colour per rank, the same for a rank whatever the count (the viewer's
    snapshot sizes it by the highest owning rank, the panel by the world size): matplotlib's tab10 colours (tab20's
    even entries), then tab20's light ones, then around again."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return torch.tensor([cmap((2 * r) % 20 + (r // 10) % 2)[:3] for r in range(num_ranks)], dtype=torch.float32)


@dataclass
class OdinModelConfig(SplatfactoModelConfig):
    """Splatfacto's configuration; every splatfacto option (`--pipeline.model.*`) keeps its meaning."""

    _target: Type = field(default_factory=lambda: OdinModel)
    views_per_step: tyro.conf.Suppress[int] = 1
    """Set by the recipe (odin_ns/recipe.py), not a flag: the views a step trains when the step-valued settings
    above were given in views. Densification's pause after an opacity reset is one epoch of views."""


def nearest_distances(points: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] distances from each point to its k nearest others (splatfacto's initial scales), with scipy's k-d tree:
    what splatfacto's `k_nearest_sklearn` computes, without importing scikit-learn (a second of every rank's
    start-up; scipy is loaded already)."""
    from scipy.spatial import cKDTree

    x = points.detach().cpu().numpy()
    distances, _ = cKDTree(x).query(x, k=k + 1)
    return torch.from_numpy(distances[:, 1:].astype("float32"))


def lpips_weights_available() -> bool:
    """True when torchvision's AlexNet weights (what LPIPS builds on) are already in the torch hub cache."""
    checkpoints = os.path.join(torch.hub.get_dir(), "checkpoints")
    return os.path.isdir(checkpoints) and any(name.startswith("alexnet") for name in os.listdir(checkpoints))


class OdinModel(SplatfactoModel):
    """Splatfacto on any device, with the Gaussians of a step chosen by the pipeline."""

    config: OdinModelConfig

    def populate_modules(self):
        """Splatfacto's `populate_modules` without its `.cuda()` on the seed colours and its LPIPS download."""
        if self.seed_points is not None and not self.config.random_init:
            means = torch.nn.Parameter(self.seed_points[0].float())
        else:
            means = torch.nn.Parameter((torch.rand((self.config.num_random, 3)) - 0.5) * self.config.random_scale)
        distances = nearest_distances(means.data, 3)
        avg_dist = distances.mean(dim=-1, keepdim=True)
        scales = torch.nn.Parameter(torch.log(avg_dist.repeat(1, 3)))
        num_points = means.shape[0]
        quats = torch.nn.Parameter(random_quat_tensor(num_points))
        dim_sh = num_sh_bases(self.config.sh_degree)
        if self.seed_points is not None and not self.config.random_init and self.seed_points[1].shape[0] > 0:
            shs = torch.zeros((self.seed_points[1].shape[0], dim_sh, 3)).float()
            seed_rgb = self.seed_points[1].float() / 255
            if self.config.sh_degree > 0:
                shs[:, 0, :3] = RGB2SH(seed_rgb)
            else:
                CONSOLE.log("use color only optimization with sigmoid activation")
                shs[:, 0, :3] = torch.logit(seed_rgb, eps=1e-10)
            features_dc = torch.nn.Parameter(shs[:, 0, :])
            features_rest = torch.nn.Parameter(shs[:, 1:, :])
        else:
            features_dc = torch.nn.Parameter(torch.rand(num_points, 3))
            features_rest = torch.nn.Parameter(torch.zeros((num_points, dim_sh - 1, 3)))
        opacities = torch.nn.Parameter(torch.logit(0.1 * torch.ones(num_points, 1)))
        gauss_params = dict(means=means, scales=scales, quats=quats, features_dc=features_dc,
                            features_rest=features_rest, opacities=opacities)

        self._populate_common()
        self.gauss_params = torch.nn.ParameterDict(gauss_params)
        self.engine = None  # the distributed engine (odin_ns.runtime.engine), attached by the pipeline for training
        self.full_snapshot: Optional[Dict[str, torch.Tensor]] = None  # the viewer's copy, on rank 0 of several
        # while rank 0 of several evaluates: (viewmat, K, width, height, SH degree) -> every owner's splats, in the
        # order one process renders them (`runtime.eval_splats.EvalSplats.request`)
        self.eval_splats: Optional[Callable] = None
        self.snapshot_owners: Optional[torch.Tensor] = None  # the owning rank of each row of the snapshot
        self.colour_by_owner = False  # the viewer's toggle: draw the snapshot in its owners' colours
        self._owner_coloured: Optional[Dict[str, torch.Tensor]] = None
        self._viewer_copy = False
        self.training_background: Optional[torch.Tensor] = None

    def _populate_common(self) -> None:
        """The rest of splatfacto's set-up (metrics, background, densification strategy), minus LPIPS's download."""
        from pytorch_msssim import SSIM
        from gsplat.strategy import DefaultStrategy
        from nerfstudio.model_components.lib_bilagrid import BilateralGrid
        from nerfstudio.utils.colors import get_color

        self.camera_optimizer = self.config.camera_optimizer.setup(num_cameras=self.num_train_data, device="cpu")
        self.psnr = PSNR(data_range=1.0)
        self.ssim = SSIM(data_range=1.0, size_average=True, channel=3)
        self.lpips = None
        if lpips_weights_available():
            from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

            self.lpips = LearnedPerceptualImagePatchSimilarity(normalize=True)
        self.step = 0
        self.crop_box = None
        if self.config.background_color == "random":
            self.background_color = torch.tensor([0.1490, 0.1647, 0.2157])  # viser's background, as splatfacto
        else:
            self.background_color = get_color(self.config.background_color)
        if self.config.use_bilateral_grid:
            self.bil_grids = BilateralGrid(num=self.num_train_data, grid_X=self.config.grid_shape[0],
                                           grid_Y=self.config.grid_shape[1], grid_W=self.config.grid_shape[2])
        self.strategy = DefaultStrategy(
            prune_opa=self.config.cull_alpha_thresh,
            grow_grad2d=self.config.densify_grad_thresh,
            grow_scale3d=self.config.densify_size_thresh,
            grow_scale2d=self.config.split_screen_size,
            prune_scale3d=self.config.cull_scale_thresh,
            prune_scale2d=self.config.cull_screen_size,
            refine_scale2d_stop_iter=self.config.stop_screen_size_at,
            refine_start_iter=self.config.warmup_length,
            refine_stop_iter=self.config.stop_split_at,
            reset_every=self.config.reset_alpha_every * self.config.refine_every,
            refine_every=self.config.refine_every,
            # one epoch of views (in steps of the recipe's batch), then one refine interval
            pause_refine_after_reset=length_in_steps(self.num_train_data, self.config.views_per_step)
            + self.config.refine_every,
            absgrad=self.config.use_absgrad,
            revised_opacity=False,
            verbose=True,
        )
        self.strategy_state = self.strategy.initialize_state(scene_scale=1.0)

    # ---- what one step renders -------------------------------------------------------------------------------

    def gaussians_for_view(self, camera: Cameras) -> Dict[str, torch.Tensor]:
        """The Gaussian parameters a view renders.

        Outside training on one of several ranks, the last gathered copy of the model (`runtime.viewer_snapshot`);
        otherwise this process's Parameters (the whole model alone).
        """
        if not self.training and self.full_snapshot is not None:
            if self.colour_by_owner and self.snapshot_owners is not None:
                return self._coloured_by_owner()
            return self.full_snapshot
        return {name: self.gauss_params[name] for name in GAUSSIAN_PARAMS}

    def _coloured_by_owner(self) -> Dict[str, torch.Tensor]:
        """The snapshot with every Gaussian in the flat colour of its owning rank (view-independent: DC only)."""
        if self._owner_coloured is None:
            snap = self.full_snapshot
            rgb = owner_palette(int(self.snapshot_owners.max().item()) + 1).to(snap["features_dc"].device)
            self._owner_coloured = dict(snap, features_dc=RGB2SH(rgb[self.snapshot_owners.long()]),
                                        features_rest=torch.zeros_like(snap["features_rest"]))
        return self._owner_coloured

    def show_snapshot(self, snapshot: Dict[str, torch.Tensor], owners: Optional[torch.Tensor]) -> "OdinModel":
        """Rank 0 of several: the copy gathered from the owners (`runtime.viewer_snapshot`) is what the viewer draws
        from now on.
        Returns a shallow copy for the viewer's render thread: its own `training` flag and snapshot, the same
        parameters and modules, so that the viewer renders beside the training steps instead of between them
        (nerfstudio's viewer flips the model to eval mode under the trainer's lock for every frame)."""
        self.full_snapshot, self.snapshot_owners, self._owner_coloured = snapshot, owners, None
        view = copy.copy(self)
        view._viewer_copy = True
        view.training = False
        return view

    def get_outputs_for_camera(self, camera: Cameras, obb_box=None):
        """Splatfacto's; on the viewer's copy without the viewer's line tracer. nerfstudio's viewer interrupts a
        frame by raising from a trace function on any Python line; beside a training step (the copy's renders do
        not hold the trainer's lock) such a raise can land inside the import machinery and leave its lock held,
        which hangs the trainer's thread at its next import. The frame runs to its end instead (and faster)."""
        if not getattr(self, "_viewer_copy", False):
            return super().get_outputs_for_camera(camera, obb_box=obb_box)
        tracer = sys.gettrace()
        sys.settrace(None)
        try:
            return super().get_outputs_for_camera(camera, obb_box=obb_box)
        finally:
            sys.settrace(tracer)

    def train(self, mode: bool = True):
        """nn.Module's, except on the viewer's copy, whose mode is its own (its sub-modules are the trainer's)."""
        if getattr(self, "_viewer_copy", False):  # (nn.Module may call it before __init__ ends)
            self.training = mode
            return self
        return super().train(mode)

    def get_training_callbacks(self, training_callback_attributes):
        """Only splatfacto's step bookkeeping: densification runs in the engine, block by block, at phase ends."""
        return [TrainingCallback([TrainingCallbackLocation.BEFORE_TRAIN_ITERATION], self.step_cb,
                                 args=[training_callback_attributes.optimizers])]

    def _get_background_color(self):
        if self.training and self.config.background_color == "random" and self.training_background is not None:
            return self.training_background
        return super()._get_background_color()

    def get_outputs(self, camera: Cameras) -> Dict[str, Union[torch.Tensor, list]]:
        """Splatfacto's `get_outputs`, device-agnostic and rendering through `odin_ns.render`."""
        if not isinstance(camera, Cameras):
            print("Called get_outputs with not a camera")
            return {}
        if self.training:
            assert camera.shape[0] == 1, "Only one camera at a time"
            optimized_camera_to_world = self.camera_optimizer.apply_to_camera(camera)
        else:
            optimized_camera_to_world = camera.camera_to_worlds

        camera_scale_fac = self._get_downscale_factor()
        camera.rescale_output_resolution(1 / camera_scale_fac)
        viewmat = get_viewmat(optimized_camera_to_world)
        K = camera.get_intrinsics_matrices().to(self.device)
        W, H = int(camera.width.item()), int(camera.height.item())
        self.last_size = (H, W)
        camera.rescale_output_resolution(camera_scale_fac)  # type: ignore

        if self.config.rasterize_mode not in ["antialiased", "classic"]:
            raise ValueError(f"Unknown rasterize_mode: {self.config.rasterize_mode}")
        render_mode = "RGB+ED" if self.config.output_depth_during_training or not self.training else "RGB"
        sh_degree_to_use = min(self.step // self.config.sh_degree_interval, self.config.sh_degree) \
            if self.config.sh_degree > 0 else None
        if not self.training and self.eval_splats is not None:  # rank 0 of several, evaluating: from the owners'
            # splats (`runtime.eval_splats`; the viewer's crop box is not an evaluation's)
            from odin_ns.render.splats import rasterize_splats

            splats, radii = self.eval_splats(viewmat.to(self.device), K, W, H, sh_degree_to_use)
            render, alpha, _ = rasterize_splats(splats, radii, W, H, render_mode)
            return self._compose_outputs(render, alpha, camera, W, H, render_mode)

        params = self.gaussians_for_view(camera)
        crop_ids = None
        if self.crop_box is not None and not self.training:
            crop_ids = self.crop_box.within(params["means"]).squeeze()
            if crop_ids.sum() == 0:
                return self.get_empty_outputs(W, H, self.background_color)
        if crop_ids is not None:
            params = {name: value[crop_ids] for name, value in params.items()}
        colors = torch.cat((params["features_dc"][:, None, :], params["features_rest"]), dim=1)
        # on the CPU the activations give an element the same bits wherever it sits, as the owners' projections
        # do (`render.projection.partition_free`): a whole-model render is then the splat path's, bit for bit
        exp, sigmoid = (torch.exp, torch.sigmoid) if self.device.type != "cpu" else (
            partial(partition_free, torch.exp), partial(partition_free, torch.sigmoid))
        if sh_degree_to_use is None:
            colors = sigmoid(colors).squeeze(1)

        render, alpha, self.info = rasterization(
            means=params["means"],
            quats=params["quats"],
            scales=exp(params["scales"]),
            opacities=sigmoid(params["opacities"]).squeeze(-1),
            colors=colors,
            viewmats=viewmat.to(self.device),
            Ks=K,
            width=W,
            height=H,
            packed=False,
            near_plane=0.01,
            far_plane=1e10,
            render_mode=render_mode,
            sh_degree=sh_degree_to_use,
            sparse_grad=False,
            absgrad=self.strategy.absgrad,
            rasterize_mode=self.config.rasterize_mode,
        )
        if self.training:
            self.strategy.step_pre_backward(self.gauss_params, self.optimizers, self.strategy_state, self.step,
                                            self.info)
        return self._compose_outputs(render, alpha, camera, W, H, render_mode)

    def _compose_outputs(self, render: torch.Tensor, alpha: torch.Tensor, camera: Cameras, W: int, H: int,
                         render_mode: str) -> Dict[str, Union[torch.Tensor, list]]:
        """Splatfacto's outputs from a rasterized image: over the background, the bilateral grid in training, the
        expected depth."""
        background = self._get_background_color()
        rgb = torch.clamp(render[:, ..., :3] + (1 - alpha) * background, 0.0, 1.0)
        if self.config.use_bilateral_grid and self.training:
            if camera.metadata is not None and "cam_idx" in camera.metadata:
                rgb = self._apply_bilateral_grid(rgb, camera.metadata["cam_idx"], H, W)
        depth_im = None
        if render_mode == "RGB+ED":
            depth_im = render[:, ..., 3:4]
            depth_im = torch.where(alpha > 0, depth_im, depth_im.detach().max()).squeeze(0)
        if background.shape[0] == 3 and not self.training:
            background = background.expand(H, W, 3)
        return {"rgb": rgb.squeeze(0), "depth": depth_im, "accumulation": alpha.squeeze(0), "background": background}

    def sh_degree_at(self, step: int) -> Optional[int]:
        """The SH degree splatfacto renders step `step` with (None: colours without SH, through a sigmoid)."""
        if self.config.sh_degree <= 0:
            return None
        return min(step // self.config.sh_degree_interval, self.config.sh_degree)

    def downscale_at(self, step: int) -> int:
        """The training resolution's downscale factor at step `step` (splatfacto's `_get_downscale_factor`)."""
        return 2 ** max(self.config.num_downscales - step // self.config.resolution_schedule, 0)

    def training_render_mode(self) -> str:
        return "RGB+ED" if self.config.output_depth_during_training else "RGB"

    def outputs_from_splats(self, splats: torch.Tensor, radii: torch.Tensor, width: int, height: int,
                            camera: Cameras) -> Dict[str, Union[torch.Tensor, list]]:
        """The reader's half of a training view (DESIGN.md "The data path"): `get_outputs` from the view's splats
        (every owner's, in global order) instead of from Gaussians; the same outputs, bit for bit."""
        from odin_ns.render.splats import rasterize_splats

        self.last_size = (height, width)
        render_mode = self.training_render_mode()
        render, alpha, self.splat_means2d = rasterize_splats(splats, radii, width, height, render_mode,
                                                             absgrad=self.strategy.absgrad)
        return self._compose_outputs(render, alpha, camera, width, height, render_mode)

    def get_image_metrics_and_images(self, outputs, batch):
        """Splatfacto's metrics; LPIPS only when its weights were available locally (see `lpips_weights_available`)."""
        if self.lpips is not None:
            return super().get_image_metrics_and_images(outputs, batch)
        gt_rgb = self.composite_with_background(self.get_gt_img(batch["image"]), outputs["background"])
        predicted_rgb = outputs["rgb"]
        combined_rgb = torch.cat([gt_rgb, predicted_rgb], dim=1)
        gt = torch.moveaxis(gt_rgb, -1, 0)[None, ...]
        pred = torch.moveaxis(predicted_rgb, -1, 0)[None, ...]
        metrics = {"psnr": float(self.psnr(gt, pred).item()), "ssim": float(self.ssim(gt, pred))}
        return metrics, {"img": combined_rgb}
