"""Ranks started with different configurations stop with one line naming the odd ranks (real gloo processes)."""

from __future__ import annotations

from gloo_ranks import run_ranks

from odin_ns.runtime.config_check import check_same_config
from odin_ns.errors import OdinInputError


def _rank(rank: int, world: int, results, configs):
    try:
        check_same_config(configs[rank], rank, world)
        results[rank] = "same"
    except OdinInputError as err:
        results[rank] = err.message


def _run(configs):
    return run_ranks(_rank, len(configs), configs)


def test_identical_configs_pass():
    results = _run([{"lr": 1.0, "steps": 3}] * 2)
    assert results == {0: "same", 1: "same"}


def test_a_different_rank_is_named_on_every_rank():
    results = _run([{"lr": 1.0}, {"lr": 1.0}, {"lr": 2.0}])
    assert set(results) == {0, 1, 2}
    for message in results.values():
        assert "ranks [2]" in message and "\n" not in message
