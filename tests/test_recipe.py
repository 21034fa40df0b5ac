"""The recipe counted in views (odin_ns/recipe.py): with B = ranks x micro-batch views a step, every step-valued
setting of the training (the defaults and the user's own overrides alike) is divided by B, the optimizer follows
Grendel-GS's sqrt rule, `--pipeline.recipe steps` turns it off; and under the scaled recipe the runtime's exactness
holds: 2 ranks equal one process with a micro-batch of 2, `odin` equals `odin-barrier`, bit for bit, through
densification and SH degree 3, and a run resumed with the same command ends where the run that never stopped ends.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import TINY_CITY, run_dir
from test_distributed_equivalence import assert_same_training, assert_sh_trained, load


def parsed(*args: str):
    from odin_ns.cli.config_union import parse_odin_config

    return parse_odin_config(["odin", *args], "test")


def test_every_step_valued_setting_counts_views_and_the_optimizer_follows_the_sqrt_rule():
    from odin_ns.recipe import apply_recipe

    given = parsed()
    for batch in (2, 3, 4):
        trained, recipe = apply_recipe(given, batch)
        assert recipe.batch == batch and recipe.scaled
        assert trained.max_num_iterations == math.ceil(30000 / batch)
        model = trained.pipeline.model
        assert model.views_per_step == batch
        for name, views in (("warmup_length", 500), ("refine_every", 100), ("stop_split_at", 15000),
                            ("sh_degree_interval", 1000), ("resolution_schedule", 3000),
                            ("stop_screen_size_at", 4000)):
            assert getattr(model, name) == round(views / batch), name
        assert model.reset_alpha_every == 30  # counts refines: scaled through refine_every
        assert trained.steps_per_save == round(2000 / batch)
        s = math.sqrt(batch)
        for group in ("means", "scales", "quats", "features_dc", "features_rest", "opacities"):
            mine, theirs = trained.optimizers[group]["optimizer"], given.optimizers[group]["optimizer"]
            assert mine.lr == pytest.approx(theirs.lr * s, rel=1e-12)
            assert mine.eps == pytest.approx(theirs.eps / s, rel=1e-12)
            assert mine.betas == pytest.approx((0.9 ** batch, 0.999 ** batch), rel=1e-12)
        means = trained.optimizers["means"]["scheduler"]
        assert means.max_steps == round(30000 / batch)
        assert means.lr_final == pytest.approx(1.6e-6 * s, rel=1e-12)
    # the user's config (what config.yml holds) keeps the user's units
    assert given.max_num_iterations == 30000 and given.pipeline.model.refine_every == 100
    assert given.optimizers["means"]["optimizer"].betas == (0.9, 0.999)


def test_one_view_a_step_and_the_steps_switch_leave_the_recipe_as_given():
    from odin_ns.recipe import apply_recipe, recipe_rows

    given = parsed("--pipeline.micro-batch", "2", "--pipeline.recipe", "steps")
    for config, ranks in ((given, 4), (parsed(), 1)):
        trained, recipe = apply_recipe(config, ranks)
        assert not recipe.scaled and recipe_rows(config, trained) == []
        assert trained == config and trained is not config


def test_overrides_are_views_like_the_defaults():
    from odin_ns.recipe import apply_recipe

    given = parsed("--max-num-iterations", "1001", "--pipeline.model.refine-every", "30",
                   "--pipeline.model.stop-screen-size-at", "0", "--optimizers.means.scheduler.max-steps", "900",
                   "--pipeline.micro-batch", "2")
    trained, recipe = apply_recipe(given, 2)  # 2 ranks x micro-batch 2
    assert recipe.batch == 4
    assert trained.max_num_iterations == 251  # every view trained: rounded up
    assert trained.pipeline.model.refine_every == 8  # 7.5 rounds to 8
    assert trained.pipeline.model.stop_screen_size_at == 0  # 0 is 'never' in any unit
    assert trained.optimizers["means"]["scheduler"].max_steps == 225


def test_evaluations_come_in_whole_phases_on_several_ranks():
    """An evaluation on several ranks is a collective that ends its phase: the scaled eval intervals are rounded up
    to multiples of `--pipeline.phase-length` there (8 ranks x 2 views: 100 views would be an eval image every 6
    steps), so the kinds fall on the same steps; one process with the same global batch, checkpoints and the steps
    switch are left alone."""
    from odin_ns.recipe import apply_recipe, recipe_rows

    given = parsed("--pipeline.micro-batch", "2", "--steps-per-eval-batch", "200")
    trained, recipe = apply_recipe(given, 8)  # B = 16
    assert recipe.eval_floor == 25 and "every whole number of phases (25 steps)" in recipe.describe(30000, 1875)
    assert (trained.steps_per_eval_image, trained.steps_per_eval_batch) == (25, 25)  # 100 / 16 and 200 / 16
    assert trained.steps_per_eval_all_images == 75  # 1000 / 16 = 62.5: three phases
    assert trained.steps_per_save == 125  # a checkpoint is not an evaluation
    assert ("steps_per_eval_image", 100, 25) in recipe_rows(given, trained)
    longer = apply_recipe(parsed("--pipeline.micro-batch", "2", "--pipeline.phase-length", "40"), 8)[0]
    assert (longer.steps_per_eval_image, longer.steps_per_eval_all_images) == (40, 80)
    two = apply_recipe(parsed(), 2)[0]  # already whole phases at 2 ranks: as scaled
    assert (two.steps_per_eval_image, two.steps_per_eval_all_images) == (50, 500)
    one, alone = apply_recipe(parsed("--pipeline.micro-batch", "16"), 1)  # no collective: no rounding
    assert alone.eval_floor == 0 and (one.steps_per_eval_image, one.steps_per_eval_batch) == (6, 0)
    steps = apply_recipe(parsed("--pipeline.recipe", "steps", "--steps-per-eval-image", "5"), 8)[0]
    assert steps.steps_per_eval_image == 5  # counted in steps by the user: as given

# The city of the runtime's tests with its densification schedule given in views for B = 2: warm-up and refine every
# 10 views (5 steps), SH degree up every 10 views, 64 views (32 steps, the last is 31), a checkpoint every 14 views
# (7 steps). The opacity reset at step 0 pauses refinement for one epoch of views, 12 training views / 2 = 6 steps,
# plus one interval: refines at steps 15, 20, 25 and 30.
VIEWS = [
    "--vis", "tensorboard", "--steps-per-eval-image", "100000", "--steps-per-eval-all-images", "100000",
    "--pipeline.model.num-downscales", "0", "--pipeline.model.warmup-length", "10",
    "--pipeline.model.refine-every", "10", "--pipeline.model.reset-alpha-every", "100",
    "--pipeline.model.densify-grad-thresh", "0.0008", "--pipeline.model.stop-screen-size-at", "0",
    "--pipeline.block-size", "256", "--pipeline.model.sh-degree-interval", "10",
    "--pipeline.check-read-sets", "True", "--steps-per-save", "14", "--save-only-latest-checkpoint", "False",
]
WHOLE = ["--max-num-iterations", "64"]


def scaled(runs, ranks: int, method: str, *extra: str, micro_batch: int = 1):
    mb = ["--pipeline.micro-batch", str(micro_batch)] if micro_batch > 1 else []
    return runs.get(ranks, method, VIEWS + list(extra) + mb + TINY_CITY)


def test_under_the_scaled_recipe_two_ranks_equal_one_process_and_odin_equals_barrier(runs):
    barrier = scaled(runs, 2, "odin-barrier", *WHOLE)
    odin = scaled(runs, 2, "odin", *WHOLE)
    one = scaled(runs, 1, "odin-barrier", *WHOLE, micro_batch=2)
    end = load(barrier)
    assert end["step"] == 31  # 64 views, 2 a step
    assert_sh_trained(end)
    assert_same_training(load(odin), end)
    assert_same_training(load(one), end)
    # the scaled optimizer is the one that ran: Grendel-GS's rule at B = 2
    group = end["optimizers"]["features_dc"]["param_groups"][0]
    assert group["lr"] == pytest.approx(0.0025 * math.sqrt(2), rel=1e-12)
    assert tuple(group["betas"]) == pytest.approx((0.81, 0.998001), rel=1e-12)
    # densification ran on the scaled schedule (refines at 15, 20, 25, 30 steps) and grew the model
    summary = json.loads((run_dir(barrier) / "odin_stats.json").read_text())
    recipe = summary["meta"]["recipe"]
    assert recipe["views_per_step"] == 2 and ["pipeline.model.refine_every", 10, 5] in recipe["changed"]
    assert recipe["eval_phase_steps"] == 25  # 2 ranks: evaluations in whole phases
    first = load(barrier, 7)["pipeline"]["_model.gauss_params.means"].shape[0]
    assert end["pipeline"]["_model.gauss_params.means"].shape[0] != first


def test_a_run_resumed_with_the_same_command_ends_where_the_uninterrupted_one_ends(runs):
    """The same command line (64 views) with --load-dir: the recipe counts the whole training, so the resumed run
    trains steps 15 to 31 and stops where the run that never stopped stops, with the same parameters and moments."""
    whole = scaled(runs, 2, "odin-barrier", *WHOLE)
    folder = str(run_dir(whole) / "nerfstudio_models")
    again = scaled(runs, 2, "odin-barrier", *WHOLE, "--load-dir", folder, "--load-step", "14")
    assert_same_training(load(again), load(whole))
    steps = json.loads((run_dir(again) / "odin_stats.json").read_text())["steps"]
    assert steps[0]["step"] == 15 and steps[-1]["step"] == 31


def test_a_resume_with_another_global_batch_is_one_line(runs, tmp_path):
    """The checkpoint's steps are steps of 2 views: one process of 1 view a step would misread them."""
    from conftest import odin_train

    whole = scaled(runs, 2, "odin-barrier", *WHOLE)
    folder = str(run_dir(whole) / "nerfstudio_models")
    with pytest.raises(AssertionError) as failed:
        odin_train(1, "odin-barrier", VIEWS + WHOLE + ["--load-dir", folder, "--load-step", "14"] + TINY_CITY,
                   tmp_path / "out")
    assert "was trained at 2 view(s) a step and this run trains 1" in str(failed.value)


def test_nothing_left_to_train_is_one_line(runs, tmp_path):
    from conftest import odin_train

    whole = scaled(runs, 2, "odin-barrier", *WHOLE)
    folder = str(run_dir(whole) / "nerfstudio_models")
    with pytest.raises(AssertionError) as failed:
        odin_train(1, "odin-barrier", VIEWS + ["--max-num-iterations", "20", "--pipeline.micro-batch", "2",
                                               "--load-dir", folder, "--load-step", "14"] + TINY_CITY,
                   tmp_path / "out")
    assert "odin: error: the checkpoint resumed from is at step 14, and the recipe ends at step 9" in str(failed.value)
