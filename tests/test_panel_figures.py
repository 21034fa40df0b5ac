"""The figures of the viewer's Odin panel, from step records as the ranks write them: the shares of the wall, the
update thread's share beside the render (throughput-first), and the chart drawn from them."""

from __future__ import annotations

from odin_ns.runtime.waits import StepRecord
from odin_ns.viewer_panel import bar_chart, describe, window_shares


def record(wall, render, update, wait, thread=0.0):
    r = StepRecord(step=0, rank=0)
    r.wall_s, r.compute_s, r.update_s = wall, render, update
    r.wait_s = {**r.wait_s, "validate": wait}
    r.background_s = {"update": thread, "transfer": 0.0}
    return r.to_dict()


def test_shares_of_the_window_add_the_update_thread_beside_the_render():
    window = [record(1.0, 0.5, 0.1, 0.3, thread=0.4), record(1.0, 0.7, 0.1, 0.1, thread=0.2)]
    shares = window_shares(window)
    assert (shares["render"], shares["update"], shares["wait"]) == (0.6, 0.1, 0.2)
    assert abs(shares["update thread"] - 0.3) < 1e-12 and shares["steps"] == 2 and shares["wall_s"] == 2.0
    assert "(+30% on the update thread)" in describe(shares)
    fig = bar_chart([shares, window_shares([record(1.0, 0.8, 0.1, 0.1)])])
    assert [t.name for t in fig.data] == ["render", "update", "wait", "update thread"]
    assert fig.layout.xaxis.range[1] > 100  # rank 0's bar passes the wall: its thread overlaps the render


def test_without_an_update_thread_the_chart_has_the_rank_parts_alone():
    shares = window_shares([record(2.0, 1.0, 0.5, 0.5)])
    assert "update thread" not in describe(shares)
    fig = bar_chart([shares, shares])
    assert [t.name for t in fig.data] == ["render", "update", "wait"]
    assert tuple(fig.layout.xaxis.range) == (0, 100.0)
    assert window_shares([])["render"] == 0.0
