"""Checkpoints of a sharded model that nerfstudio's own tools open unchanged.

Rank 0 writes what `Trainer.save_checkpoint` writes for plain splatfacto (`step`, `pipeline`, `optimizers`,
`schedulers`, `scalers`), with the Gaussian parameters and their Adam moments replaced by the whole model's,
gathered from the owners in block order. The file is written beside its final name and renamed into place, so a
rank that dies mid-save never leaves a torn checkpoint: the last complete one stays loadable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from odin_ns.runtime.sharded import PARAM_NAMES


def plain(obj):
    """numpy scalars (nerfstudio's schedulers leave numpy.float64 learning rates) as Python numbers, recursively:
    `torch.load` defaults to `weights_only=True`, which refuses numpy objects, and nerfstudio's tools call it so."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(plain(obj), tmp)
    os.replace(tmp, path)


def write_full_checkpoint(trainer, step: int, full: Dict[str, torch.Tensor],
                          moments: Dict[str, Dict[str, torch.Tensor]]) -> Path:
    """Rank 0: the checkpoint of the whole model (`full` params, `moments[name][key]` optimizer state).

    Alone, `full` and `moments` are this process's own tensors; the file is then exactly nerfstudio's."""
    trainer.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    pipeline_state = trainer.pipeline.state_dict()
    for name in PARAM_NAMES:
        pipeline_state[f"_model.gauss_params.{name}"] = full[name]
    optimizers = {}
    for group, optimizer in trainer.optimizers.optimizers.items():
        state = optimizer.state_dict()
        state["state"] = {k: dict(v) for k, v in state["state"].items()}  # state_dict() shares the live dicts
        if group in moments:
            for key, value in moments[group].items():
                state["state"].setdefault(0, {})[key] = value
        optimizers[group] = state
    path = trainer.checkpoint_dir / f"step-{step:09d}.ckpt"
    atomic_save({
        "step": step,
        "pipeline": pipeline_state,
        "optimizers": optimizers,
        "schedulers": {k: v.state_dict() for k, v in trainer.optimizers.schedulers.items()},
        "scalers": trainer.grad_scaler.state_dict(),
    }, path)
    if trainer.config.save_only_latest_checkpoint:
        for old in trainer.checkpoint_dir.glob("*.ckpt"):
            if old != path:
                old.unlink()
    return path


def checkpoint_to_load(config) -> Path | None:
    """The checkpoint `--load-dir` (latest step, or `--load-step`) or `--load-checkpoint` names, as nerfstudio."""
    from odin_ns.errors import OdinInputError

    if config.load_dir is not None:
        folder = Path(config.load_dir)
        steps = sorted(int(p.stem.split("-")[1]) for p in folder.glob("step-*.ckpt")) if folder.is_dir() else []
        if not steps:
            raise OdinInputError(f"no checkpoint (step-*.ckpt) in --load-dir {folder}")
        step = config.load_step if config.load_step is not None else steps[-1]
        path = folder / f"step-{step:09d}.ckpt"
    elif config.load_checkpoint is not None:
        path = Path(config.load_checkpoint)
    else:
        return None
    if not path.exists():
        raise OdinInputError(f"checkpoint {path} does not exist")
    return path

