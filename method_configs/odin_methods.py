"""MethodSpecifications for `ns-train odin`, `ns-train odin-throughput` and `ns-train odin-barrier`.

The three share splatfacto's training recipe and differ only in the synchronization policy that runs across ranks
(DESIGN.md): `odin` (quality-first: the synchronous result, waiting only for the blocks a view reads),
`odin-throughput` (admitted, bounded delayed reads), `odin-barrier` (a global barrier every step, the baseline).
On one rank there is nothing to synchronize and the three are the same training.
"""

from __future__ import annotations

from nerfstudio.configs.base_config import MachineConfig, ViewerConfig
from nerfstudio.engine.optimizers import AdamOptimizerConfig
from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig
from nerfstudio.plugins.types import MethodSpecification

from odin_ns.pipeline import OdinPipelineConfig
from odin_ns.scene.optimizer_config import SelectiveAdamOptimizerConfig
from odin_ns.schedule.policies import POLICIES
from odin_ns.trainer import OdinTrainerConfig, default_device_type



def _gaussian_optimizers(max_steps: int) -> dict:
    """Splatfacto's optimizer recipe (nerfstudio 1.1.5, `method_configs["splatfacto"]`), with the visibility-masked
    Adam of DESIGN.md on the Gaussians (a Gaussian no view of a step touched is left as it is, moments included)."""
    return {
        "means": {
            "optimizer": SelectiveAdamOptimizerConfig(lr=1.6e-4, eps=1e-15),
            "scheduler": ExponentialDecaySchedulerConfig(lr_final=1.6e-6, max_steps=max_steps),
        },
        "features_dc": {"optimizer": SelectiveAdamOptimizerConfig(lr=0.0025, eps=1e-15), "scheduler": None},
        "features_rest": {"optimizer": SelectiveAdamOptimizerConfig(lr=0.0025 / 20, eps=1e-15), "scheduler": None},
        "opacities": {"optimizer": SelectiveAdamOptimizerConfig(lr=0.05, eps=1e-15), "scheduler": None},
        "scales": {"optimizer": SelectiveAdamOptimizerConfig(lr=0.005, eps=1e-15), "scheduler": None},
        "quats": {"optimizer": SelectiveAdamOptimizerConfig(lr=0.001, eps=1e-15), "scheduler": None},
        "camera_opt": {
            "optimizer": AdamOptimizerConfig(lr=1e-4, eps=1e-15),
            "scheduler": ExponentialDecaySchedulerConfig(lr_final=5e-7, max_steps=max_steps, warmup_steps=1000,
                                                         lr_pre_warmup=0),
        },
        "bilateral_grid": {
            "optimizer": AdamOptimizerConfig(lr=2e-3, eps=1e-15),
            "scheduler": ExponentialDecaySchedulerConfig(lr_final=1e-4, max_steps=max_steps, warmup_steps=1000,
                                                         lr_pre_warmup=0),
        },
    }


def make_trainer_config(policy: str) -> OdinTrainerConfig:
    """The full training config of one odin method; every field takes nerfstudio's usual override."""
    max_steps = 30000
    return OdinTrainerConfig(
        method_name=POLICIES[policy].method,
        steps_per_eval_image=100,
        steps_per_eval_batch=0,
        steps_per_save=2000,
        steps_per_eval_all_images=1000,
        max_num_iterations=max_steps,
        mixed_precision=False,
        machine=MachineConfig(device_type=default_device_type()),
        pipeline=OdinPipelineConfig(policy=policy),
        optimizers=_gaussian_optimizers(max_steps),
        viewer=ViewerConfig(num_rays_per_chunk=1 << 15),
        vis="viewer",
    )


def _spec(policy: str) -> MethodSpecification:
    return MethodSpecification(config=make_trainer_config(policy), description=POLICIES[policy].description)


# one method per policy of the registry (`odin_ns.schedule.policies`), under its method's name with "_" for "-":
# the names pyproject.toml's entry points give nerfstudio
METHODS = {p.method: _spec(p.name) for p in POLICIES.values()}
globals().update({method.replace("-", "_"): spec for method, spec in METHODS.items()})
