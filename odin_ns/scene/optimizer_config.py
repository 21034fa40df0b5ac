"""nerfstudio config for `SelectiveAdam`, so a method config can name it where splatfacto names Adam:

    "means": {"optimizer": SelectiveAdamOptimizerConfig(lr=1.6e-4, eps=1e-15), "scheduler": ...}

Kept apart from `selective_adam` because importing nerfstudio costs seconds and the optimizer itself is plain torch.
nerfstudio's `OptimizerConfig.setup` passes every field except `_target` and `max_norm` as a keyword argument, so
the fields below are exactly `SelectiveAdam`'s keyword arguments (the pattern of `AdamOptimizerConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Type

from nerfstudio.engine.optimizers import OptimizerConfig

from odin_ns.scene.selective_adam import SelectiveAdam


@dataclass
class SelectiveAdamOptimizerConfig(OptimizerConfig):
    """Visibility-masked Adam (see odin_ns/scene/selective_adam.py for the exact update)."""

    _target: Type = SelectiveAdam
    betas: Tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates."""
    bias_correction: bool = True
    """Adam's bias correction (True: torch.optim.Adam's update, its fused kernel's bits, when every row is visible;
    False: the formula of gsplat's kernel)."""
    require_visibility: bool = False
    """Make a step without a visibility mask an error instead of a dense update."""
