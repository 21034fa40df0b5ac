"""`odin-bench`'s arithmetic on runs' summaries (no training): rounds pooled, and the scalings that cancel a machine's
drift between runs."""

from __future__ import annotations

import pytest

from odin_ns.cli.bench import compare, pooled_run


def run(policy: str, wall: float, render: float, cpu: float, waits: float, label: str | None = None) -> dict:
    """A 2-rank run whose ranks rendered `render` s, waited `waits` s and used `cpu` s of processor time each."""
    rank = {"render_s": render, "update_s": 0.0, "background_update_s": 0.0, "bookkeeping_s": 0.0, "loop_s": 0.0,
            "wait_s": {"validate": waits, "transfer": 0.0, "barrier": 0.0, "phase": 0.0, "gather": 0.0},
            "wall_s": wall, "cpu_s": cpu}
    summary = {"ranks": 2, "views": 100, "train_wall_s": wall, "views_per_s": 100 / wall, "no_wait_bound_s": render,
               "per_rank": [dict(rank), dict(rank)], "wait_s": dict(rank["wait_s"]), "bytes_per_step": 1.0,
               "read_set_misses": 0, "misses_handled": 0, "mean_blocks_read": 1.0, "mean_blocks_total": 1.0}
    return {"summary": summary, "label": label or policy, "policy": policy, "method": policy, "schedule": "odin"}


def test_equal_cpu_cancels_a_slower_machine_and_counts_a_threads_work():
    barrier = run("barrier", wall=10.0, render=6.0, cpu=6.0, waits=4.0)
    # the same work as barrier's, on a machine twice as slow: raw 0.5x, 1.00x at equal speed and at equal CPU
    slow = run("quality", wall=20.0, render=12.0, cpu=12.0, waits=8.0)
    # a lane on a thread: the main thread's own work is 5 s, but its processes used 6.5 s (the lane's 1.5 s): the
    # main-thread scaling takes it for a faster machine, the processor time does not
    thread = run("throughput", wall=8.0, render=5.0, cpu=6.5, waits=3.0)
    rows = {r["policy"]: r for r in compare([barrier, slow, thread])}
    assert rows["quality"]["speedup"] == pytest.approx(0.5)
    assert rows["quality"]["speedup_equal_speed"] == pytest.approx(1.0)
    assert rows["quality"]["speedup_equal_cpu"] == pytest.approx(1.0)
    assert rows["quality"]["wait_hidden_equal_cpu"] == pytest.approx(0.0)
    assert rows["throughput"]["speedup_equal_speed"] == pytest.approx(10.0 / (8.0 * 6.0 / 5.0))
    assert rows["throughput"]["speedup_equal_cpu"] == pytest.approx(10.0 / (8.0 * 6.0 / 6.5))
    # ideal 6 s, barrier's wait 4 s; at equal CPU the thread run's wall is 8 * 6 / 6.5
    assert rows["throughput"]["wait_hidden_equal_cpu"] == pytest.approx(1 - (8.0 * 6.0 / 6.5 - 6.0) / 4.0)


def test_rounds_pool_into_one_longer_run():
    a, b = run("barrier", 10.0, 6.0, 6.0, 4.0), run("barrier", 14.0, 8.0, 8.5, 6.0)
    pooled = pooled_run([a, b])
    s = pooled["summary"]
    assert s["train_wall_s"] == 24.0 and s["views"] == 200 and s["views_per_s"] == pytest.approx(200 / 24.0)
    assert s["per_rank"][0]["render_s"] == 14.0 and s["per_rank"][1]["cpu_s"] == 14.5
    assert s["per_rank"][0]["wait_s"]["validate"] == 10.0 and s["wait_s"]["validate"] == 10.0
    assert pooled["round_walls_s"] == [10.0, 14.0]
    assert a["summary"]["train_wall_s"] == 10.0  # the rounds themselves are left as they were
