"""`odin-bench scaling`'s arithmetic on made-up runs: the speed-up in time to quality is taken seed by seed against
the 1-rank run of the same seed (then the mean), a seed's rounds give their median wall, quality and the model's
size are compared with the reference's means; and the runs an invocation makes."""

from __future__ import annotations

import pytest

from odin_ns.cli.bench_scaling import runs_of, summarize


def run(wall: float, psnr: float, gaussians: int, ranks: int = 1, steps: int = 10):
    return {"summary": {"train_wall_s": wall, "views": 20, "steps": steps}, "process_wall_s": wall + 5,
            "ranks": ranks, "metrics": {"psnr": psnr, "ssim": 0.5}, "gaussians": gaussians}


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
    assert same["speedup"] == 1.0 and same["psnr_delta"] == 0.0


def test_an_invocation_runs_the_reference_the_same_batch_in_one_process_and_each_method():
    labels = [r["label"] for r in runs_of(4, ["odin", "odin-throughput"], [1, 2])]
    assert labels == ["1 rank", "1 process, micro-batch 4", "4 ranks, odin", "4 ranks, odin-throughput",
                      "4 ranks x micro-batch 2, odin"]
