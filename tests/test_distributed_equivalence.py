"""N real ranks (gloo, separate processes) equal one process training the same global batch, bit for bit.

DESIGN.md semantics 1-3: step t renders every view of the global batch from the parameters after step t-1, sums
the gradients in rank order and applies selective Adam. One rank with a micro-batch of N views is that reference;
N ranks with one view each (or two) must give the same parameters and Adam moments, through densification, with
the global barrier (`odin-barrier`) and without it (`odin`, quality-first: a rank waits only for the blocks its
views read), and a run resumed from a checkpoint (on the same or another rank count) must end where the run that
never stopped ends.

Every comparison reaches SH degree 3 inside its window (`--pipeline.model.sh-degree-interval 5`) and checks that
every SH coefficient and its Adam moments are non-zero there: the paths that move only the parameter columns that
changed (higher SH coefficients travel once they train) are compared on values, not on zeros. Runs are shared
between tests that check different things of them (`conftest.Runs`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST_TRAINING, FOX, TINY_CITY, last_checkpoint, run_dir

GAUSS = ["means", "scales", "quats", "features_dc", "features_rest", "opacities"]
SH = ["--pipeline.model.sh-degree-interval", "5"]  # SH degree 1 at step 5, 3 from step 15
CITY = FAST_TRAINING + SH + ["--max-num-iterations", "32", "--pipeline.check-read-sets", "True"]
KEEP = ["--steps-per-save", "7", "--save-only-latest-checkpoint", "False"]  # checkpoints at 7, 14, 21, 28, 31
RECOMPUTE = ["--pipeline.projection-memory", "recompute"]  # no projection keeps its graph
# auto with a budget: the graphs kept until 1 MB (the city's first steps at 3 ranks, 0.3-0.9 MB a step), the
# projections beyond made again at the update (its later ones, up to 4.8 MB a step): GPUs' default, on CPU ranks
BUDGET = ["--pipeline.projection-budget-mb", "1"]
NCCL_RECEIVES = {"ODIN_NS_RECEIVES_AHEAD": "0"}  # gloo posts each receive when it is needed, as NCCL does


def load(out: Path, step: int | None = None):
    path = last_checkpoint(out) if step is None else run_dir(out) / "nerfstudio_models" / f"step-{step:09d}.ckpt"
    return torch.load(path, map_location="cpu", weights_only=False)


def stats(out: Path):
    return json.loads((run_dir(out) / "odin_stats.json").read_text())


def eval_metrics(out: Path):
    """nerfstudio's evaluations of every held-out image in a run (its tensorboard events): {metric: [(step,
    value)]} for PSNR and SSIM."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = run_dir(out).glob("events.out.tfevents*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    prefix = "Eval Images Metrics Dict (all images)/"
    return {m: [(e.step, e.value) for e in acc.Scalars(prefix + m)] for m in ("psnr", "ssim")}


def assert_same_training(a, b):
    assert a["step"] == b["step"]
    for name in GAUSS:
        x, y = a["pipeline"][f"_model.gauss_params.{name}"], b["pipeline"][f"_model.gauss_params.{name}"]
        assert x.shape == y.shape, (name, x.shape, y.shape)
        assert torch.equal(x, y), f"{name} differs: max |diff| {(x - y).abs().max().item()}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizers"][name]["state"][0][key], b["optimizers"][name]["state"][0][key]), \
                (name, key)


def assert_sh_trained(ckpt):
    """Every SH coefficient of degree 1-3 and its Adam moments are non-zero in some Gaussian: what the comparison
    compared was trained, not zeros both sides started with."""
    rest = ckpt["pipeline"]["_model.gauss_params.features_rest"]
    assert rest.shape[1] == 15, rest.shape
    moments = ckpt["optimizers"]["features_rest"]["state"][0]
    for name, tensor in (("values", rest), ("exp_avg", moments["exp_avg"]), ("exp_avg_sq", moments["exp_avg_sq"])):
        per_coefficient = (tensor != 0).flatten(2).any(dim=2).any(dim=0)
        assert per_coefficient.all(), f"SH {name} all zero for coefficients {torch.nonzero(~per_coefficient).tolist()}"


def city(runs, ranks: int, method: str, *extra: str, micro_batch: int = 1, env=None) -> Path:
    mb = ["--pipeline.micro-batch", str(micro_batch)] if micro_batch > 1 else []
    return runs.get(ranks, method, CITY + list(extra) + mb + TINY_CITY, extra_env=env)


def resumed(runs, ranks: int, method: str, source: Path, step: int, *extra: str, micro_batch: int = 1) -> Path:
    """`method` resumed from `source`'s checkpoint at `step` and trained to the same last step (31)."""
    folder = str(run_dir(source) / "nerfstudio_models")
    mb = ["--pipeline.micro-batch", str(micro_batch)] if micro_batch > 1 else []
    args = [a for a in CITY if a not in ("--max-num-iterations", "32")] + [
        "--max-num-iterations", str(31 - step), "--load-dir", folder, "--load-step", str(step)]
    return runs.get(ranks, method, args + list(extra) + mb + TINY_CITY)


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_equal_one_process_on_city(runs, ranks):
    # checkpoints along the way (a gather of the whole model and its moments, a phase boundary) must not disturb
    # training: only the barrier run writes them
    barrier = city(runs, ranks, "odin-barrier", *KEEP)
    # at 3 ranks the owners keep their projections' graphs within a budget and beyond it only their splats,
    # projecting again at the update, a pair at a time (the barrier keeps each projection's graph): the same model,
    # less held; and, as on NCCL, each receive is posted when its handler needs it (the GPUs' path of the receives)
    odin = city(runs, ranks, "odin", *(BUDGET if ranks == 3 else ()), env=NCCL_RECEIVES if ranks == 3 else None)
    ref = load(city(runs, 1, "odin-barrier", micro_batch=ranks))
    dist = load(barrier)
    assert_sh_trained(ref)
    assert_same_training(dist, ref)
    assert_same_training(load(odin), ref)
    odin_stats, barrier_stats = stats(odin), stats(barrier)
    assert odin_stats["summary"]["wait_s"]["barrier"] == 0.0 < barrier_stats["summary"]["wait_s"]["barrier"]
    assert odin_stats["summary"]["read_set_misses"] == 0
    assert odin_stats["summary"]["phases"] >= 3, "the compared steps should span several phases"
    posted_ahead = (barrier_stats,) if ranks == 3 else (odin_stats, barrier_stats)
    for s in posted_ahead:  # gloo: every header and gradient received into a buffer posted ahead
        assert s["summary"]["receives_ahead"] >= s["summary"]["receives"] / 2 > 0, s["summary"]["receives"]
    if ranks == 3:
        assert odin_stats["summary"]["receives_ahead"] == 0 < odin_stats["summary"]["receives"]
    if ranks == 3:  # the most held by projections: within the budget, or one pair's graph at the update against
        # a whole step's
        again, kept = (s["summary"]["peak_projection_bytes_per_rank"] for s in (odin_stats, barrier_stats))
        assert all(0 < a < 0.75 * k for a, k in zip(again, kept)), (again, kept)
        summary = odin_stats["summary"]
        assert summary["projections_kept"] > 0 and summary["projections_again"] > 0, "the budget chose one kind"
        assert barrier_stats["summary"]["projections_again"] == 0  # CPU ranks' auto: every graph kept
    final = dist["pipeline"]["_model.gauss_params.means"].shape[0]
    assert final != 1500, "densification did not run within the compared steps"
    owned = barrier_stats["summary"]["peak_gaussians_owned"]
    assert len(owned) == ranks and all(0 < o < final for o in owned), owned
    assert barrier_stats["summary"]["bytes_sent"] > 0
    assert barrier_stats["summary"]["read_set_misses"] == 0  # owners found no kept Gaussian outside a read set
    steps = barrier_stats["steps"]
    assert any(r["blocks_read"] < r["blocks_total"] for r in steps), "read sets never excluded a block"
    blocks = [r["blocks_total"] for r in steps if r["rank"] == 0]
    assert blocks[-1] > blocks[0], f"grown blocks were never cut at a phase boundary: {blocks[0]} -> {blocks[-1]}"
    views = [r["views"][0] for r in steps if r["step"] == 3]
    assert len(set(views)) == ranks, f"ranks drew the same camera: {views}"


def test_the_splats_an_odin_run_moves_and_holds(runs):
    """What travels is splats (owners project for their readers: 44 bytes a visible pair out, 40 back, headers
    included) and no rank holds another's rows: each rank's peak is its owned rows with Adam's moments and a
    step's messages, well under one process's whole model."""
    s = stats(city(runs, 2, "odin"))["summary"]
    assert s["remote_pairs"] > 0
    assert s["bytes_per_pair_to_reader"] <= 44.5 and s["bytes_per_pair_back"] <= 40.0
    assert max(s["peak_resident_share"]) < 0.7  # its owned rows, of the whole model
    assert max(s["peak_bytes_share"]) < 0.75  # of one process's rows with Adam's moments
    # the message buffers alive at once: some, and fewer than the run moved (each is let go once delivered)
    assert all(0 < m < s["bytes_sent"] for m in s["peak_message_bytes_per_rank"]), s["peak_message_bytes_per_rank"]


def test_two_views_per_rank_equal_one_process_with_four(runs):
    odin = city(runs, 2, "odin", micro_batch=2)
    ref = load(city(runs, 1, "odin-barrier", micro_batch=4))
    assert_sh_trained(ref)
    assert_same_training(load(odin), ref)
    views = [r["views"] for r in stats(odin)["steps"] if r["step"] == 3]
    assert all(len(v) == 2 for v in views) and len({x for v in views for x in v}) == 4, views


@pytest.mark.parametrize("ranks,micro_batch", [(2, 1), (1, 2)], ids=["same-ranks", "one-rank"])
def test_a_resumed_barrier_run_ends_where_the_uninterrupted_one_ends(runs, ranks, micro_batch):
    """From the 2-rank run's checkpoint at step 14 (after SH degree 2, before densification ends and degree 3)
    to step 31: the same parameters and moments as the run that never stopped, on 2 ranks and on one rank with
    the same global batch. The checkpoint keeps the blocks, gsplat's statistics since the last refine and
    throughput-first's evidence, so nothing a later step reads differs."""
    whole = city(runs, 2, "odin-barrier", *KEEP)
    assert load(whole, 14)["step"] == 14
    again = resumed(runs, ranks, "odin-barrier", whole, 14, *KEEP, micro_batch=micro_batch)
    end = load(whole)
    assert_sh_trained(end)
    assert_same_training(load(again), end)
    assert stats(again)["steps"][0]["step"] == 15


@pytest.mark.parametrize("ranks", [2, 3])
def test_odin_equals_barrier_on_the_aerial_survey(runs, ranks):
    """The aerial capture, where read sets are local (views read a part of the blocks): odin's waits follow the
    data alone, and after densification, block cuts and a rebalance it still holds what odin-barrier holds."""
    aerial = ["--pipeline.block-size", "64", "odin-city", "--width", "48", "--height", "36", "--blocks-x", "6",
              "--blocks-y", "6", "--num-street-cameras", "0", "--num-aerial-cameras", "0",
              "--num-survey-cameras", "16", "--num-points", "2000"]
    args = FAST_TRAINING + SH + ["--max-num-iterations", "27"] + aerial  # refines at 20 and 25 (after 16 views)
    barrier = load(runs.get(ranks, "odin-barrier", args))
    odin_out = runs.get(ranks, "odin", args)
    assert_sh_trained(barrier)
    assert_same_training(load(odin_out), barrier)
    odin_stats = stats(odin_out)
    blocks = [r["blocks_total"] for r in odin_stats["steps"] if r["rank"] == 0]
    assert blocks[-1] > blocks[0], f"grown blocks were never cut: {blocks[0]} -> {blocks[-1]}"
    assert odin_stats["summary"]["wait_s"]["barrier"] == 0.0
    assert any(r["blocks_read"] < r["blocks_total"] // 2 for r in odin_stats["steps"]), "no view read a local part"


def test_a_rank_that_owns_no_block_still_takes_part(runs):
    """One block for two ranks: one rank owns nothing, fetches everything, and the result is still the reference;
    an evaluation at step 8 (every held-out view) renders from one owner's splats alone, as one process does."""
    args = FAST_TRAINING + SH + ["--max-num-iterations", "16", "--pipeline.block-size", "100000",
                                 "--steps-per-eval-all-images", "8"]
    dist = runs.get(2, "odin", args + TINY_CITY)
    one = runs.get(1, "odin-barrier", args + ["--pipeline.micro-batch", "2"] + TINY_CITY)
    ref = load(one)
    assert_sh_trained(ref)
    assert_same_training(load(dist), ref)
    assert sorted(stats(dist)["summary"]["peak_gaussians_owned"]) == [0, 1500]
    expected = eval_metrics(one)
    assert [s for s, _ in expected["psnr"]] == [8] and eval_metrics(dist) == expected
    assert stats(dist)["summary"]["eval_renders"] > 0


@pytest.mark.skipif(not (FOX / "transforms.json").exists(), reason="the shared fox photos are not present")
def test_ranks_equal_one_process_on_fox(runs):
    """Real photos; nerfstudio evaluates every held-out view at steps 8 and 16. On 2 ranks each of those renders
    is made from every owner's splats on rank 0 (no rank gathers the whole model for it): the same PSNR and SSIM,
    bit for bit, as one process rendering its whole model, and the evaluations' phase ends leave training as it
    is."""
    args = ["--data", str(FOX), "--pipeline.datamanager.camera-res-scale-factor", "0.0625",
            "--pipeline.model.random-init", "True", "--pipeline.model.num-random", "3000",
            "--pipeline.model.random-scale", "2.0"] + FAST_TRAINING + SH + ["--max-num-iterations", "24",
                                                                             "--steps-per-eval-all-images", "8"]
    one = runs.get(1, "odin-barrier", args + ["--pipeline.micro-batch", "2", "instant-ngp-data"])
    ref = load(one)
    assert_sh_trained(ref)
    expected = eval_metrics(one)
    assert [s for s, _ in expected["psnr"]] == [8, 16], expected
    for method in ("odin-barrier", "odin"):
        out = runs.get(2, method, args + ["instant-ngp-data"])
        assert_same_training(load(out), ref)
        assert eval_metrics(out) == expected, method
        renders = stats(out)["summary"]["eval_renders"]
        assert renders > 0 and renders % 2 == 0, renders  # every held-out view, twice


def test_a_gaussian_pushed_outside_its_planned_bounds_is_added_to_the_read_set(runs):
    """Semantics 6: a Gaussian moved by hand inside a phase (no optimizer can move it that far) onto the optical
    axis of a view whose read set lacks its block. The owner's envelope check finds it, the block is added to that
    view's read set before the view renders, and the result is still the synchronous one: odin equals
    odin-barrier and one process, and the owners' exhaustive check finds no kept Gaussian outside what a view
    rendered (without the repair it would count the pushed one)."""
    args = FAST_TRAINING + ["--max-num-iterations", "14", "--pipeline.check-read-sets", "True"]
    push = {"ODIN_NS_FAULT_PUSH": "8"}
    odin = runs.get(2, "odin", args + TINY_CITY, extra_env=push)
    barrier = runs.get(2, "odin-barrier", args + TINY_CITY, extra_env={**push, **NCCL_RECEIVES})  # NCCL's receives
    ref = runs.get(1, "odin-barrier", args + ["--pipeline.micro-batch", "2"] + TINY_CITY, extra_env=push)
    assert_same_training(load(odin), load(ref))
    assert_same_training(load(barrier), load(ref))
    for run in (odin, barrier, ref):
        summary = stats(run)["summary"]
        assert summary["plan_violations"] >= 1 and summary["misses_handled"] >= 1, (run, summary)
        assert summary["read_set_misses"] == 0, (run, summary)
    assert stats(barrier)["summary"]["receives_ahead"] == 0 < stats(barrier)["summary"]["receives"]
