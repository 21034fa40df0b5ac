"""The nerfstudio Trainer seam: device choice and clear errors before any work starts.

nerfstudio defaults `--machine.device-type` to cuda; the odin methods default to CUDA when it is available and
the CPU otherwise, and a request for CUDA on a machine without it ends in one line instead of a CUDA traceback
deep inside the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Type

import torch

from nerfstudio.engine.trainer import Trainer, TrainerConfig

from odin_ns.errors import OdinInputError


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


@dataclass
class OdinTrainerConfig(TrainerConfig):
    """nerfstudio's TrainerConfig; `ns-train odin*` builds the odin trainer from it."""

    _target: Type = field(default_factory=lambda: OdinTrainer)


class OdinTrainer(Trainer):
    """nerfstudio's Trainer, checking the device before it allocates anything."""

    def __init__(self, config: OdinTrainerConfig, local_rank: int = 0, world_size: int = 1) -> None:
        check_device(config.machine.device_type)
        super().__init__(config, local_rank, world_size)
