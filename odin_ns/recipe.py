"""The recipe at N ranks: splatfacto's schedule counted in training views, the optimizer scaled by the batch.

splatfacto's recipe counts steps of one view. A step of Odin trains a global batch of B = ranks x micro-batch
views, so with `--pipeline.recipe views` (the default) every step-valued setting of the training is read as a
number of views and divided by B when the trainer starts: the length (`--max-num-iterations`), the checkpoint and
evaluation intervals, densification (warm-up, interval, stop, the screen-size stop, the pause after an opacity
reset, which is one epoch of views), the SH degree interval, the resolution schedule and the learning-rate
schedulers' lengths. So one command line trains the same number of views on any rank count, and a user's own
overrides are scaled like the defaults: they are in the same unit. `--pipeline.recipe steps` turns the scaling
off: every setting counts steps (nerfstudio's meaning, each step trains B views) and the optimizer is left as set.
The runtime's own step counts (`--pipeline.phase-length`, `--pipeline.viewer-refresh-every`) and nerfstudio's
logging interval are not the recipe's and stay in steps; `--pipeline.model.reset-alpha-every` counts refines.
On several ranks an evaluation is a collective that ends its phase (`schedule.phase_planner.eval_intervals`): the
scaled evaluation intervals are rounded up to whole phases (multiples of `--pipeline.phase-length` steps, so that
the kinds of evaluation fall on the same steps), and a large global batch does not cut every phase short for
monitoring (100 views at 16 views a step would be an eval image every 6 steps of 25-step phases). The exact
policies train the same whatever the phases; throughput-first's reads behind stop at a phase end, so its training
depends on where they fall, as on every phase end.

The optimizer follows Grendel-GS's published sqrt rule (`--lr_scale_mode sqrt`, scene/gaussian_model.py: "Scale
learning rates according to bsz"): learning rates x sqrt(B) (the schedulers' final and pre-warm-up rates too),
Adam's eps / sqrt(B) and betas ** B (the moments decay over the same number of views). gsplat's
examples/simple_trainer.py publishes the same learning-rate and eps rule with betas 1 - B (1 - beta), equal to
first order, which reaches 0 at B = 10; the power form holds at any batch. Odin sums the gradients of a step's
views where those trainers average them: Adam's update does not see the difference but for eps (1e-15 here).

What one rule cannot give is written by hand here: which of nerfstudio's and splatfacto's fields count steps.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Dict, List, Literal, Tuple

RecipeUnits = Literal["views", "steps"]

# nerfstudio's TrainerConfig fields that count steps (the length counts too, rounded up: every view is trained)
TRAINER_INTERVALS = ("steps_per_save", "steps_per_eval_batch", "steps_per_eval_image", "steps_per_eval_all_images")
EVAL_INTERVALS = TRAINER_INTERVALS[1:]  # each ends its phase on several ranks: rounded up to whole phases
# splatfacto's SplatfactoModelConfig fields that count steps (reset_alpha_every counts refines: scaled through
# refine_every)
MODEL_STEPS = ("warmup_length", "refine_every", "resolution_schedule", "stop_split_at", "stop_screen_size_at",
               "sh_degree_interval")
# nerfstudio's scheduler configs: fields that count steps, fields that are learning rates
SCHEDULER_STEPS = ("max_steps", "warmup_steps", "warm_up_end")
SCHEDULER_RATES = ("lr_final", "lr_pre_warmup")


def steps_of(views: int, batch: int) -> int:
    """A step-valued setting given in views, in steps of `batch` views: 0 stays 0 (nerfstudio's 'never'), anything
    else rounds to the nearest step and is at least one."""
    return 0 if views == 0 else max(1, math.floor(views / batch + 0.5))


def length_in_steps(views: int, batch: int) -> int:
    """The training's length: enough steps to train `views` views (rounded up)."""
    return -(-views // batch)


@dataclass(frozen=True)
class Recipe:
    """How the trainer read the configuration: `batch` views a step (ranks x micro-batch), in `units`."""

    batch: int
    units: RecipeUnits = "views"
    eval_floor: int = 0  # evaluations' intervals in multiples of this many steps (a phase on several ranks; 0: any)

    @property
    def scaled(self) -> bool:
        return self.units == "views" and self.batch > 1

    @property
    def lr_factor(self) -> float:
        return math.sqrt(self.batch) if self.scaled else 1.0

    def describe(self, views: int, steps: int) -> str:
        """One line for the job's log."""
        if self.units == "steps":
            return (f"odin: recipe counted in steps (--pipeline.recipe steps): {steps} steps of {self.batch} view(s), "
                    "the optimizer as configured")
        if self.batch == 1:
            return f"odin: recipe counted in views: {views} views, one a step (splatfacto's recipe)"
        s = self.lr_factor
        floor = (f", evaluations every whole number of phases ({self.eval_floor} steps)" if self.eval_floor > 1
                 else "")
        return (f"odin: recipe counted in views: {views} views in {steps} steps of {self.batch} "
                f"(ranks x micro-batch); every interval / {self.batch}{floor}; learning rates x {s:.3g}, Adam eps / "
                f"{s:.3g}, betas ** {self.batch} (Grendel-GS's sqrt rule); --pipeline.recipe steps turns this off")


def scale_optimizer(entry: Dict, recipe: Recipe) -> None:
    """One group of nerfstudio's `optimizers` dict (its optimizer config and scheduler config), in place."""
    if not recipe.scaled:
        return
    b, s = recipe.batch, recipe.lr_factor
    opt = entry.get("optimizer")
    if opt is not None:
        opt.lr = opt.lr * s
        if getattr(opt, "eps", None) is not None:
            opt.eps = opt.eps / s
        if getattr(opt, "betas", None) is not None:
            opt.betas = tuple(beta ** b for beta in opt.betas)
    sched = entry.get("scheduler")
    if sched is not None:
        for name in SCHEDULER_STEPS:
            if isinstance(getattr(sched, name, None), int):
                setattr(sched, name, steps_of(getattr(sched, name), b))
        if hasattr(sched, "milestones"):
            sched.milestones = tuple(steps_of(m, b) for m in sched.milestones)
        for name in SCHEDULER_RATES:
            if getattr(sched, name, None) is not None:
                setattr(sched, name, getattr(sched, name) * s)


def apply_recipe(config, world_size: int):
    """(a copy of the trainer config with the recipe applied for `world_size` ranks, the Recipe). The config the
    user gave (and config.yml, written from it) keeps the user's units; only the trainer's copy counts steps. On
    several ranks the scaled evaluation intervals are whole numbers of phases (module docstring)."""
    pipeline = config.pipeline
    recipe = Recipe(batch=world_size * pipeline.micro_batch, units=pipeline.recipe)
    config = copy.deepcopy(config)
    if not recipe.scaled:
        return config, recipe
    if world_size > 1:
        recipe = Recipe(batch=recipe.batch, units=recipe.units, eval_floor=pipeline.phase_length)
    b = recipe.batch
    config.max_num_iterations = length_in_steps(config.max_num_iterations, b)
    for name in TRAINER_INTERVALS:
        steps = steps_of(getattr(config, name), b)
        if steps and name in EVAL_INTERVALS and recipe.eval_floor:
            steps = -(-steps // recipe.eval_floor) * recipe.eval_floor
        setattr(config, name, steps)
    model = config.pipeline.model
    for name in MODEL_STEPS:
        setattr(model, name, steps_of(getattr(model, name), b))
    model.views_per_step = b
    for entry in config.optimizers.values():
        scale_optimizer(entry, recipe)
    return config, recipe


def recipe_rows(original, scaled) -> List[Tuple[str, object, object]]:
    """(setting, as given, as trained) for every setting the recipe changed: odin_stats.json's record of it."""
    rows = [("max_num_iterations", original.max_num_iterations, scaled.max_num_iterations)]
    rows += [(n, getattr(original, n), getattr(scaled, n)) for n in TRAINER_INTERVALS]
    rows += [(f"pipeline.model.{n}", getattr(original.pipeline.model, n), getattr(scaled.pipeline.model, n))
             for n in MODEL_STEPS]
    for group, entry in original.optimizers.items():
        mine = scaled.optimizers[group]
        for part in ("optimizer", "scheduler"):
            a, b = entry.get(part), mine.get(part)
            if a is None:
                continue
            for name in ("lr", "eps", "betas", *SCHEDULER_STEPS, "milestones", *SCHEDULER_RATES):
                if hasattr(a, name):
                    rows.append((f"optimizers.{group}.{part}.{name}", getattr(a, name), getattr(b, name)))
    return [r for r in rows if r[1] != r[2]]
