"""Checkpoints of a sharded model that nerfstudio's own tools open unchanged.

Rank 0 writes what `Trainer.save_checkpoint` writes for plain splatfacto (`step`, `pipeline`, `optimizers`,
`schedulers`, `scalers`), with the Gaussian parameters and their Adam moments replaced by the whole model's,
gathered from the owners in block order. The file is written beside its final name and renamed into place, so a
rank that dies mid-save never leaves a torn checkpoint: the last complete one stays loadable.
"""

from __future__ import annotations

import os
import pickle
import zipfile
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
                          moments: Dict[str, Dict[str, torch.Tensor]], resume: Dict | None = None) -> Path:
    """Rank 0: the checkpoint of the whole model (`full` params, `moments[name][key]` optimizer state).

    Alone, `full` and `moments` are this process's own tensors; the file is then nerfstudio's, plus the "odin"
    entry nerfstudio's tools ignore: the scene it was trained on and `resume` (the engine's `resume_state`)."""
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
        "odin": {"scene": scene_identity(trainer), "resume": resume,
                 "recipe": {"units": trainer.recipe.units, "views_per_step": trainer.recipe.batch}},
    }, path)
    if trainer.config.save_only_latest_checkpoint:
        for old in trainer.checkpoint_dir.glob("*.ckpt"):
            if old != path:
                old.unlink()
    return path


def scene_identity(trainer) -> Dict:
    """What the checkpoint was trained on, saved beside nerfstudio's keys (its tools ignore extra keys), so that a
    resume on another scene is refused instead of training one scene's Gaussians on another's photos."""
    dataparser = trainer.config.pipeline.datamanager.dataparser
    data = getattr(dataparser, "data", None) or trainer.config.pipeline.datamanager.data
    return {"dataparser": type(dataparser).__name__,
            "data": str(Path(data).resolve()) if data and str(data) not in ("", ".") else "",
            "train_views": len(trainer.pipeline.datamanager.train_dataset)}


def _describe(scene: Dict) -> str:
    where = scene["data"] or "the built-in city"
    return f"{where} ({scene['dataparser']}, {scene['train_views']} training views)"


def check_same_scene(path: Path, saved: Dict | None, current: Dict) -> None:
    """A checkpoint of another scene (other data, parser or views) ends in one line; a foreign checkpoint
    without the record (plain splatfacto) is taken as it is."""
    from odin_ns.errors import OdinInputError

    if saved is not None and saved != current:
        raise OdinInputError(f"checkpoint {path} was trained on {_describe(saved)}, but this run trains on "
                             f"{_describe(current)} (give the --data the checkpoint was trained on, or leave "
                             "--load-dir out to start afresh)")


def check_same_recipe(path: Path, saved: Dict | None, recipe) -> None:
    """A recipe counted in views counts steps of the checkpoint's global batch: resuming it with another batch
    would misread its step (and every interval after it), so that is one line; a checkpoint without the record
    (written before it, or plain splatfacto) is taken as it is, and so is any checkpoint under `--pipeline.recipe
    steps`."""
    from odin_ns.errors import OdinInputError

    if saved is None or recipe.units != "views" or saved.get("units") != "views":
        return
    if saved["views_per_step"] != recipe.batch:
        raise OdinInputError(
            f"checkpoint {path} was trained at {saved['views_per_step']} view(s) a step and this run trains "
            f"{recipe.batch} (ranks x --pipeline.micro-batch); the recipe counts views, so its steps differ: resume "
            f"with a global batch of {saved['views_per_step']} (e.g. --pipeline.micro-batch "
            f"{saved['views_per_step']} on one rank), or add --pipeline.recipe steps")


def _step_of(path: Path) -> int:
    return int(path.stem.split("-")[1])


def _read(path: Path):
    """The checkpoint's contents, or the exception that reading it raised (a truncated file, not a checkpoint, one
    whose objects torch's safe loading refuses). Its tensors are the file mapped into memory (copy on write), so
    that the ranks of a node resuming from one checkpoint share its pages, each copying out only its own rows
    (what the run keeps of it is copied: `unmapped`); a file in torch's older format, which cannot be mapped, is
    read whole."""
    try:
        with torch.serialization.safe_globals(_numpy_scalars()):
            return torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        return exc  # torch's zip reader raises RuntimeError; its safe loading UnpicklingError


def _numpy_scalars() -> list:
    """What torch's safe loading must also accept in a plain splatfacto checkpoint: numpy's float64 learning rates,
    which nerfstudio's schedulers leave in its optimizers' and schedulers' state (this project's own checkpoints
    hold Python numbers instead: `plain`)."""
    try:
        from numpy.core.multiarray import scalar
    except ImportError:  # numpy 2
        from numpy._core.multiarray import scalar
    return [scalar, np.dtype, type(np.dtype(np.float64))]


def unmapped(obj):
    """`obj` with every tensor in it copied out of the checkpoint's mapped file (what a run keeps of a checkpoint
    beyond its own rows: another optimizer's state), so that the run holds none of the file."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: unmapped(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unmapped(v) for v in obj)
    return obj


def load_checkpoint_state(config, say=print):
    """(path, contents) of the checkpoint `--load-dir` (latest step, or `--load-step`) or `--load-checkpoint`
    names, as nerfstudio picks it, or None when none is asked for.

    A newest checkpoint that cannot be read (a run killed mid-save on a file system without atomic renames, a copy
    cut short) is named, and the newest complete one beside it is resumed from with a notice (`--load-dir`
    without a step) or offered (an explicit step or file)."""
    from odin_ns.errors import OdinInputError

    if config.load_dir is not None:
        folder = Path(config.load_dir)
        found = sorted(folder.glob("step-*.ckpt"), key=_step_of) if folder.is_dir() else []
        if not found:
            raise OdinInputError(f"no checkpoint (step-*.ckpt) in --load-dir {folder}")
        if config.load_step is None:
            for newest in reversed(found):
                state = _read(newest)
                if not isinstance(state, Exception):
                    if newest != found[-1]:
                        say(f"odin: notice: resuming from {newest.name}, the newest complete checkpoint in "
                            f"{folder}: {', '.join(p.name for p in found if _step_of(p) > _step_of(newest))} "
                            "cannot be read (truncated or corrupt)")
                    return newest, state
            raise OdinInputError(f"no checkpoint in --load-dir {folder} can be read (all {len(found)} are truncated "
                                 f"or corrupt; the newest is {found[-1].name})")
        path = folder / f"step-{config.load_step:09d}.ckpt"
    elif config.load_checkpoint is not None:
        path = Path(config.load_checkpoint)
        found = sorted(path.parent.glob("step-*.ckpt"), key=_step_of)
    else:
        return None
    if not path.exists():
        raise OdinInputError(f"checkpoint {path} does not exist")
    state = _read(path)
    if isinstance(state, Exception):
        others = [p for p in reversed(found) if p != path and not isinstance(_read(p), Exception)]
        offer = (f"; the newest complete checkpoint beside it is {others[0]} (--load-step {_step_of(others[0])})"
                 if others else "; no complete checkpoint is beside it")
        raise OdinInputError(f"checkpoint {path} cannot be read (truncated or corrupt){offer}")
    return path, state
