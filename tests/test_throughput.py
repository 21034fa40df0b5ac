"""odin-throughput (DESIGN.md semantics 4) on real ranks: deterministic, bounded, exact at zero thresholds.

A read may use a block's version one update behind when the plan and the runtime's evidence admit it; the late
gradient is applied by the owner to the newer version. The same run twice is the same bit for bit (once with the
communication lane inline, once on a thread), and so is a run
resumed from one of its checkpoints (the checkpoint keeps each block's evidence); no read is more than
--pipeline.max-staleness behind or behind across a phase boundary (checked on the run's own stats); with the
admission thresholds at zero only reads of blocks the pending steps leave unchanged are admitted, and the result is
odin's, bit for bit. Its quality against odin-barrier is a measurement (`odin-bench train`, held-out PSNR over
seeds), not a test.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from conftest import FAST_TRAINING, TINY_CITY, script
from test_distributed_equivalence import GAUSS, KEEP, NCCL_RECEIVES, RECOMPUTE, assert_same_training, \
    assert_sh_trained, city, load, resumed, stats



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


def test_throughput_is_deterministic_bounded_and_not_odin(runs):
    a_out = city(runs, 2, "odin-throughput", *KEEP)
    # the same run again, its communication lane on a thread beside the renders instead of inline (the default on
    # CPU ranks): other timings and another order of work, the same versions read, the same model; and the owners
    # keep only their projections' splats, projecting again at the update (reads behind from a copy of the rows
    # they took: what auto does on GPUs beyond its budget), each receive posted when its handler needs it (the
    # GPUs' lane, NCCL's receives)
    b_out = city(runs, 2, "odin-throughput", *KEEP, "--pipeline.lane", "thread", *RECOMPUTE, env=NCCL_RECEIVES)
    a, b = load(a_out), load(b_out)
    assert stats(b_out)["summary"]["receives_ahead"] == 0 < stats(b_out)["summary"]["receives"]
    assert stats(b_out)["summary"]["projections_kept"] == 0 < stats(b_out)["summary"]["projections_again"]
    assert_sh_trained(a)
    assert_same_training(a, b)
    run_stats = stats(a_out)
    admitted = check_bounds(run_stats, 1)
    summary = run_stats["summary"]
    assert admitted == summary["stale_admitted"] > 0, "no read was ever admitted behind"
    assert summary["stale_refused"] > 0, "the evidence never refused a read (after a refine it is unknown)"
    assert summary["max_skipped_update"] > 0, "the skipped updates' sizes were not recorded"
    assert summary["wait_s"]["barrier"] == 0.0
    # reads behind change the result (and densification still ran through it)
    odin = load(city(runs, 2, "odin"))
    pairs = [(a["pipeline"][f"_model.gauss_params.{n}"], odin["pipeline"][f"_model.gauss_params.{n}"]) for n in GAUSS]
    assert any(x.shape != y.shape or not torch.equal(x, y) for x, y in pairs), "reads behind changed nothing"


def test_two_views_a_rank_on_a_thread_lane_equal_the_inline_lane(runs):
    """Two views a rank a step: the lane sends a view's gradients once it is rendered, on a thread while the next
    view renders, inline before it; the same reads, the same model, bit for bit (the inline run is the one
    `tests/test_program.py` checks against its lists)."""
    inline = load(city(runs, 2, "odin-throughput", micro_batch=2))
    thread = load(city(runs, 2, "odin-throughput", "--pipeline.lane", "thread", micro_batch=2))
    assert_sh_trained(inline)
    assert_same_training(inline, thread)


def test_reads_behind_move_splats_projected_when_their_version_was_current(runs):
    """An owner projects a read admitted behind when its version is current (it replays the reader's decision;
    the reader checks that the owner agreed), so reads behind move splats too, and no rank keeps another's rows
    or an older version of its own."""
    s = stats(city(runs, 2, "odin-throughput", *KEEP))["summary"]
    assert s["stale_admitted"] > 0 and s["remote_pairs"] > 0
    assert s["bytes_per_pair_to_reader"] <= 46.0 and s["bytes_per_pair_back"] <= 40.0  # headers: counts, evidence
    assert max(s["peak_bytes_share"]) < 0.75
    # on gloo every header and gradient is received into a buffer posted before its handler needs it (in each
    # pair's order, `runtime.inbox`); only a publication's splats wait for their header: at most half the receives
    assert s["receives_ahead"] >= s["receives"] / 2 > 0, (s["receives_ahead"], s["receives"])


def test_a_block_that_leaves_its_bounds_reaches_the_reads_behind_too(runs):
    """A Gaussian pushed by hand outside its block's planned bounds (DESIGN.md semantics 6), under reads admitted
    behind: the owner keeps the block on its list of blocks outside for the rest of the phase and projects it for
    every view that sees it, whether the view's read takes the version of the push or a later one, current or
    behind; the owners' exhaustive check finds nothing a view kept outside what it rendered."""
    args = FAST_TRAINING + ["--max-num-iterations", "14", "--pipeline.check-read-sets", "True"] + TINY_CITY
    # pushed from step 6: in this city's view order a view of step 8 renders the pushed Gaussian through a read
    # behind (pushed from step 8, no view of the steps left sees it); the lane inline, each receive posted when its
    # handler needs it (NCCL's receives)
    summary = stats(runs.get(2, "odin-throughput", args, extra_env={"ODIN_NS_FAULT_PUSH": "6", **NCCL_RECEIVES}))[
        "summary"]
    assert summary["receives_ahead"] == 0 < summary["receives"]
    assert summary["stale_admitted"] > 0
    assert summary["plan_violations"] >= 1 and summary["misses_handled"] >= 1, summary
    assert summary["read_set_misses"] == 0, summary


def test_a_resumed_throughput_run_ends_where_the_uninterrupted_one_ends(runs):
    """Resumed from the checkpoint at step 14 with the evidence it saved: the same admissions, so the same result
    as the run that never stopped, bit for bit (without the evidence, the first reads after the resume would be
    refused and the runs would part)."""
    whole = city(runs, 2, "odin-throughput", *KEEP)
    again = resumed(runs, 2, "odin-throughput", whole, 14, *KEEP)
    end = load(whole)
    assert_sh_trained(end)
    assert_same_training(load(again), end)
    assert stats(again)["summary"]["stale_admitted"] > 0


def test_checkpoints_at_refine_steps_and_a_run_resumed_from_one(runs):
    """Checkpoints at every refine step (splatfacto's defaults put every one there while it densifies): one after a
    refine that added blocks keeps no evidence (unknown after a structural change, as the run itself holds it; it
    once indexed the old blocks' evidence and failed), and a run resumed from one keeps its blocks, which a run
    lets grow to twice --pipeline.block-size before it cuts them (they were cut afresh, and the runs parted):
    it ends where the uninterrupted run ends, bit for bit."""
    every_refine = ["--steps-per-save", "5", "--save-only-latest-checkpoint", "False"]  # refine every 5 steps
    whole = city(runs, 2, "odin-throughput", *every_refine)
    checkpoints = {s: load(whole, s) for s in (20, 25)}
    blocks = {s: len(c["odin"]["resume"]["blocks"]) for s, c in checkpoints.items()}
    assert blocks[25] > blocks[20], blocks  # the refine at step 25 added blocks
    assert max(checkpoints[20]["odin"]["resume"]["blocks"]) > 256  # blocks the block size does not bound
    assert bool(torch.isinf(checkpoints[25]["odin"]["resume"]["evidence"]).all())
    assert_same_training(load(resumed(runs, 2, "odin-throughput", whole, 20, *every_refine)), load(whole))


def test_two_versions_behind_stay_within_their_bound(runs):
    s2 = stats(city(runs, 2, "odin-throughput", "--pipeline.max-staleness", "2"))
    check_bounds(s2, 2)
    assert s2["summary"]["max_staleness_seen"] == 2


def test_zero_thresholds_equal_odin_bit_for_bit(runs):
    zero = city(runs, 2, "odin-throughput", "--pipeline.admit-overlap", "0", "--pipeline.admit-update", "0")
    odin = load(city(runs, 2, "odin"))
    assert_sh_trained(odin)
    assert_same_training(load(zero), odin)


@pytest.mark.parametrize("option,value,words", [("max_staleness", -1, "0 or more"),
                                                ("admit_overlap", 1.5, "in [0, 1]"),
                                                ("admit_update", -0.1, "0 or more"),
                                                ("projection_budget_mb", -1.0, "0 or more")])
def test_bad_admission_options_are_refused_when_parsed(option, value, words):
    """What every rank's parse does (the dataclass check); the launched paths of such a flag are below and in
    test_launcher_errors (2 ranks)."""
    from odin_ns.errors import OdinInputError
    from odin_ns.pipeline import OdinPipelineConfig

    with pytest.raises(OdinInputError, match=r"--pipeline\." + option.replace("_", "-") + ".*" + re.escape(words)):
        OdinPipelineConfig(**{option: value})


def test_a_projection_budget_is_refused_beside_keep_or_recompute():
    from odin_ns.errors import OdinInputError
    from odin_ns.pipeline import OdinPipelineConfig

    for mode in ("keep", "recompute"):
        with pytest.raises(OdinInputError, match=r"--pipeline\.projection-budget-mb is auto's budget"):
            OdinPipelineConfig(projection_memory=mode, projection_budget_mb=5.0)
    assert OdinPipelineConfig(projection_budget_mb=5.0).projection_budget_mb == 5.0  # auto takes it


def test_a_bad_admission_flag_fails_ns_train_in_one_line(tmp_path):
    flag = "--pipeline.admit-overlap"
    proc = subprocess.run([script("ns-train"), "odin-throughput", flag, "1.5", "--vis", "tensorboard",
                           "--output-dir", str(tmp_path / "out"), "odin-city"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("odin: error:")]
    assert len(lines) == 1 and flag in lines[0] and "in [0, 1]" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists(), "a rejected flag wrote output"
