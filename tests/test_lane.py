"""Throughput-first's communication lane (`runtime.lane`) against its list: when each group of actions runs.

The handlers here only note what they are given: the lane's order is what is tested; the messages themselves are
the real runs' (`tests/test_program.py`, `tests/test_throughput.py`)."""

from __future__ import annotations

import threading

import pytest

from odin_ns.runtime.interpreter import Program, StepContext
from odin_ns.runtime.lane import Lane
from odin_ns.schedule.actions import parse_action


def _lane(mode: str, actions=None):
    # by default one step, two views: each view's gradients to rank 1, then the update
    actions = actions or [parse_action(t, 0) for t in ("R v0", "G~ s0 b2->r1", "R v1", "G~ s1 b2->r1", "U~ b0")]
    ran, sent = [], threading.Event()

    def note(group, ctx):
        ran.append((group[0].kind, [a.slot for a in group] if group[0].kind == "G" else None, ctx.step))
        if group[0].kind == "G":
            sent.set()

    handlers = {"G": note, "U": note, "P": note, "decide": lambda a, until: True, "probe": lambda a: True}
    return Lane(Program(actions, rank=0, start=0, stop=1), handlers, mode=mode), ran, sent


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_a_views_gradients_go_once_it_is_rendered_and_the_update_after_the_steps_renders(mode):
    lane, ran, sent = _lane(mode)
    ctx = StepContext(0, None)
    lane.ready(0)
    assert ran == []  # nothing rendered yet
    lane.rendered(ctx, 0)
    assert sent.wait(10.0)
    assert ran == [("G", [0], 0)]  # the first view's gradients, alone: the second view is not rendered
    sent.clear()
    lane.rendered(ctx, 1)
    assert sent.wait(10.0)
    assert ran == [("G", [0], 0), ("G", [1], 0)]  # the update waits for the step's renders (`put`)
    lane.put(ctx)
    lane.join()
    assert ran == [("G", [0], 0), ("G", [1], 0), ("U", None, 0)]


def test_an_inline_lane_sends_a_gradient_without_a_view_after_the_steps_renders():
    """A hand-built G without a view slot (-1) waits for the step's renders, inline as on a thread."""
    from odin_ns.schedule.actions import Action

    lane, ran, _ = _lane("inline", [parse_action("R v0", 0), Action("G", 0, 1, (2,), on_thread=True),
                                    parse_action("R v1", 0), parse_action("U~ b0", 0)])
    ctx = StepContext(0, None)
    lane.ready(0)
    lane.rendered(ctx, 0)
    lane.rendered(ctx, 1)
    assert ran == []
    lane.put(ctx)
    lane.join()
    assert ran == [("G", [-1], 0), ("U", None, 0)]
