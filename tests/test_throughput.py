"""odin-throughput (DESIGN.md semantics 4) on real ranks: deterministic, bounded, exact at zero thresholds.

A read may use a block's version one update behind when the plan and the runtime's evidence admit it; the late
gradient is applied by the owner to the newer version. The same run twice is the same bit for bit; no read is
more than --pipeline.max-staleness behind or behind across a phase boundary (checked on the run's own stats);
with the admission thresholds at zero only reads of blocks the pending steps leave unchanged are admitted, and
the result is odin's, bit for bit.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conftest import FAST_TRAINING, TINY_CITY, last_checkpoint, odin_train, run_dir, script
from test_distributed_equivalence import GAUSS, assert_same_training

TRAIN = FAST_TRAINING + ["--max-num-iterations", "32"]  # refines at 10, 15, ..., 30: several phases
ARGS = TRAIN + TINY_CITY


def _load(out):
    return torch.load(last_checkpoint(out), map_location="cpu", weights_only=False)


def _stats(out):
    return json.loads((run_dir(out) / "odin_stats.json").read_text())


@pytest.fixture(scope="module")
def odin_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("odin")
    odin_train(2, "odin", ARGS, out)
    return out


def check_bounds(stats, max_staleness: int) -> int:
    """Every admitted read within the bound and inside its phase; the number of block reads admitted behind."""
    admitted = 0
    for rank in (0, 1):
        records = sorted((r for r in stats["steps"] if r["rank"] == rank), key=lambda r: r["step"])
        phase_start = None
        for r in records:
            if r["phase_start"]:
                phase_start = r["step"]
                assert not r["stale_reads"], f"a read behind at the phase start, step {r['step']}: {r}"
            for e in r["stale_reads"]:
                assert 1 <= e["staleness"] <= max_staleness, e
                # the version read (that of update step-1-k) is never older than the phase-start state
                assert r["step"] - e["staleness"] >= phase_start, (r["step"], phase_start, e)
                assert e["estimate"] <= 0.05 + 1e-12, e  # the default admission threshold
                admitted += e["blocks"]
    return admitted


def test_throughput_is_deterministic_bounded_and_not_odin(tmp_path, odin_run):
    odin_train(2, "odin-throughput", ARGS, tmp_path / "a")
    odin_train(2, "odin-throughput", ARGS, tmp_path / "b")
    a, b = _load(tmp_path / "a"), _load(tmp_path / "b")
    assert_same_training(a, b)
    stats = _stats(tmp_path / "a")
    admitted = check_bounds(stats, 1)
    summary = stats["summary"]
    assert admitted == summary["stale_admitted"] > 0, "no read was ever admitted behind"
    assert summary["stale_refused"] > 0, "the evidence never refused a read (after a refine it is unknown)"
    assert summary["max_skipped_update"] > 0, "the skipped updates' sizes were not recorded"
    assert summary["wait_s"]["barrier"] == 0.0
    # reads behind change the result (and densification still ran through it)
    odin = _load(odin_run)
    pairs = [(a["pipeline"][f"_model.gauss_params.{n}"], odin["pipeline"][f"_model.gauss_params.{n}"]) for n in GAUSS]
    assert any(x.shape != y.shape or not torch.equal(x, y) for x, y in pairs), "reads behind changed nothing"


def test_two_versions_behind_stay_within_their_bound(tmp_path):
    odin_train(2, "odin-throughput", TRAIN + ["--pipeline.max-staleness", "2"] + TINY_CITY, tmp_path / "s2")
    stats = _stats(tmp_path / "s2")
    check_bounds(stats, 2)
    assert stats["summary"]["max_staleness_seen"] == 2


def test_zero_thresholds_equal_odin_bit_for_bit(tmp_path, odin_run):
    zero = ["--pipeline.admit-overlap", "0", "--pipeline.admit-update", "0"]
    odin_train(2, "odin-throughput", zero + ARGS, tmp_path / "zero")
    assert_same_training(_load(tmp_path / "zero"), _load(odin_run))


@pytest.mark.parametrize("flag,value,words", [("--pipeline.max-staleness", "-1", "0 or more"),
                                              ("--pipeline.admit-overlap", "1.5", "in [0, 1]"),
                                              ("--pipeline.admit-update", "-0.1", "0 or more")])
def test_bad_admission_flags_fail_in_one_line(tmp_path, flag, value, words):
    proc = subprocess.run([script("ns-train"), "odin-throughput", flag, value, "--vis", "tensorboard",
                           "--output-dir", str(tmp_path / "out"), "odin-city"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("odin: error:")]
    assert len(lines) == 1 and flag in lines[0] and words in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists(), "a rejected flag wrote output"


def _held_out_psnr(out) -> float:
    result = out / "eval.json"
    subprocess.run([script("ns-eval"), "--load-config", str(run_dir(out) / "config.yml"), "--output-path",
                    str(result)], check=True, capture_output=True, timeout=300)
    return float(json.loads(result.read_text())["results"]["psnr"])


def test_throughput_quality_stays_near_barrier(tmp_path):
    """Held-out PSNR after a short real run (150 steps, 2 ranks, one seed) within QUALITY_MARGIN_DB of
    odin-barrier's on the same steps. The 0.1 dB target is a mean over 3 seeds at full length (the benchmark in
    the README); one short run differs from the synchronous one by the chaotic drift a single missed update
    starts (the same order as two seeds of odin-barrier itself), hence the wider margin here, which a read
    behind a large update, or a late gradient applied to the wrong version, would still exceed."""
    args = ["--vis", "tensorboard", "--steps-per-eval-image", "100000", "--steps-per-eval-all-images", "100000",
            "--pipeline.model.num-downscales", "0", "--pipeline.model.warmup-length", "20",
            "--pipeline.model.refine-every", "50", "--pipeline.block-size", "256", "--max-num-iterations", "150",
            "odin-city", "--width", "64", "--height", "48", "--num-street-cameras", "24", "--num-aerial-cameras",
            "4", "--num-points", "1500"]
    odin_train(2, "odin-barrier", args, tmp_path / "barrier")
    odin_train(2, "odin-throughput", args, tmp_path / "throughput")
    barrier, throughput = _held_out_psnr(tmp_path / "barrier"), _held_out_psnr(tmp_path / "throughput")
    assert _stats(tmp_path / "throughput")["summary"]["stale_admitted"] > 0
    assert abs(throughput - barrier) <= QUALITY_MARGIN_DB, (throughput, barrier)


QUALITY_MARGIN_DB = 0.3
