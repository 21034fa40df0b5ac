"""`odin-bench scaling`'s arithmetic on made-up runs: the speed-up in time to quality is taken seed by seed against
the 1-rank run of the same seed (then the mean), a seed's rounds give their median wall, quality and the model's
size are compared with the reference's means; and the runs an invocation makes."""

from __future__ import annotations

import pytest

from odin_ns.cli.bench_scaling import runs_of, summarize


def run(wall: float, psnr: float, gaussians: int, ranks: int = 1, steps: int = 10, render=None):
    per_rank = [{"render_s": c} for c in (render if render is not None else [wall / ranks] * ranks)]
    return {"summary": {"train_wall_s": wall, "views": 20, "steps": steps, "per_rank": per_rank},
            "process_wall_s": wall + 5, "ranks": ranks, "metrics": {"psnr": psnr, "ssim": 0.5},
            "gaussians": gaussians}


def test_speedup_is_per_seed_against_the_same_seeds_reference():
    reference = {1: [run(100, 20.0, 1000, steps=20)], 2: [run(300, 21.0, 1200, steps=20)]}
    # seed 1: 50 s (2x); seed 2: rounds of 100, 140 and 400 s, median 140 s (300/140)
    tries = {1: [run(50, 19.9, 900, ranks=2)], 2: [run(100, 20.9, 1300, ranks=2), run(400, 0, 0, ranks=2),
                                                  run(140, 0, 0, ranks=2)]}
    row = summarize("2 ranks", tries, reference)
    assert row["speedup_per_seed"] == pytest.approx([2.0, 300 / 140])
    assert row["speedup"] == pytest.approx((2.0 + 300 / 140) / 2)
    assert row["train_wall_s"] == pytest.approx((50 + 140) / 2)
    assert row["psnr"] == pytest.approx(20.4) and row["psnr_delta"] == pytest.approx(-0.1)
    assert row["gaussians_ratio"] == pytest.approx(1100 / 1100)
    assert row["steps"] == 10 and row["ranks"] == 2
    same = summarize("1 rank", reference, reference)
    assert same["speedup"] == 1.0 and same["psnr_delta"] == 0.0 and same["speedup_equal_speed"] == 1.0


def test_at_equal_render_speed_the_wall_is_scaled_by_the_render_seconds_of_the_same_views():
    # the reference rendered 80 s of its 100 s; 2 ranks rendered the same views in 70 + 50 = 120 s (their cores
    # ran slower) within 60 s: at the reference's render speed they would have taken 60 * 80 / 120 = 40 s, 2.5x
    reference = {1: [run(100, 20.0, 1000, render=[80])]}
    row = summarize("2 ranks", {1: [run(60, 20.0, 1000, ranks=2, render=[70, 50])]}, reference)
    assert row["speedup"] == pytest.approx(100 / 60)
    assert row["speedup_equal_speed"] == pytest.approx(2.5) and row["render_s_per_seed"] == [120]


def test_an_invocation_runs_the_reference_the_same_batch_in_one_process_and_each_method():
    labels = [r["label"] for r in runs_of(4, ["odin", "odin-throughput"], [1, 2])]
    assert labels == ["1 rank", "1 process, micro-batch 4", "4 ranks, odin", "4 ranks, odin-throughput",
                      "4 ranks x micro-batch 2, odin"]


def test_kept_runs_are_summarized_again_without_training(tmp_path):
    import json

    from odin_ns.cli.bench_scaling import RUN_FILE, summarize_kept

    for order, label, ranks, wall in ((0, "1 rank", 1, 100.0), (1, "2 ranks, odin", 2, 60.0)):
        for seed in (1, 2):
            folder = tmp_path / f"{label}-{seed}" / "outputs" / "run"
            folder.mkdir(parents=True)
            (folder / "odin_stats.json").write_text(json.dumps({"summary": run(wall, 20.0 + seed, 1000,
                                                                                 ranks=ranks)["summary"]}))
            (tmp_path / f"{label}-{seed}" / RUN_FILE).write_text(json.dumps(
                {"order": order, "label": label, "seed": seed, "round": 0, "ranks": ranks, "scene": "city",
                 "views": 20, "process_wall_s": None, "metrics": {"psnr": 20.0 + seed, "ssim": 0.5},
                 "gaussians": 1000}))
    out = tmp_path / "rows.json"
    assert summarize_kept(tmp_path, out) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == ["1 rank", "2 ranks, odin"]
    assert rows[1]["speedup"] == pytest.approx(100 / 60) and rows[1]["psnr_delta"] == pytest.approx(0.0)
    assert rows[1]["process_wall_s"] is None
