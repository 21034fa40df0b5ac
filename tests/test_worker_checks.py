"""Ranks started with different configurations stop with one line naming the odd ranks (real gloo processes)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from odin_ns.runtime.config_check import check_same_config
from odin_ns.errors import OdinInputError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, configs, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        check_same_config(configs[rank], rank, world)
        results[rank] = "same"
    except OdinInputError as err:
        results[rank] = err.message
    finally:
        dist.destroy_process_group()


def _run(configs):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank, args=(len(configs), _free_port(), configs, results), nprocs=len(configs), join=True)
    return dict(results)


def test_identical_configs_pass():
    results = _run([{"lr": 1.0, "steps": 3}] * 2)
    assert results == {0: "same", 1: "same"}


def test_a_different_rank_is_named_on_every_rank():
    results = _run([{"lr": 1.0}, {"lr": 1.0}, {"lr": 2.0}])
    assert set(results) == {0, 1, 2}
    for message in results.values():
        assert "ranks [2]" in message and "\n" not in message
