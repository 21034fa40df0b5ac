"""The view schedule: nerfstudio's camera order, cut into global batches; ranks never share a camera in a step."""

from __future__ import annotations

import random

import pytest

from odin_ns.schedule.views import ViewSchedule


def nerfstudio_order(num_views: int, seed: int, count: int):
    """What FullImageDatamanager.next_train draws: epochs of shuffles from one random.Random(seed)."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        order = list(range(num_views))
        rng.shuffle(order)
        out += order
    return out[:count]


def test_one_rank_follows_nerfstudio_order():
    s = ViewSchedule(num_views=7, seed=42)
    assert [s.views(t, 0)[0] for t in range(30)] == nerfstudio_order(7, 42, 30)


@pytest.mark.parametrize("ranks,micro", [(2, 1), (3, 1), (2, 2)])
def test_global_batch_is_the_same_on_any_rank_count(ranks, micro):
    dist = ViewSchedule(num_views=11, num_ranks=ranks, micro_batch=micro, seed=5)
    ref = ViewSchedule(num_views=11, num_ranks=1, micro_batch=ranks * micro, seed=5)
    for t in range(25):
        flat = [v for r in range(ranks) for v in dist.views(t, r)]
        assert flat == ref.views(t, 0)


def test_ranks_get_different_views_within_a_step():
    s = ViewSchedule(num_views=40, num_ranks=4, seed=1)
    for t in range(9):  # within one epoch every view appears once
        views = [v for r in range(4) for v in s.views(t, r)]
        assert len(set(views)) == 4


def test_csv_round_trip_lists_every_slot():
    s = ViewSchedule(num_views=5, num_ranks=2, micro_batch=2, seed=0)
    lines = s.to_csv(3, 2).strip().splitlines()
    assert lines[0] == "step,rank,slot,view"
    assert len(lines) == 1 + 2 * 2 * 2
    assert lines[1] == f"3,0,0,{s.views(3, 0)[0]}"


def test_rejects_empty_dataset():
    with pytest.raises(ValueError):
        ViewSchedule(num_views=0)
