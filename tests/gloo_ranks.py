"""Real gloo processes for the tests of collectives: `run_ranks(body, world, *args)` starts `world` processes in one
gloo group, calls `body(rank, world, results, *args)` in each (a module-level function: it is pickled), and
returns what they put in `results` (a shared dict)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(body, world: int, *args) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_in_group, args=(body, world, _free_port(), results, args), nprocs=world, join=True)
    return dict(results)


def _in_group(rank: int, body, world: int, port: int, results, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        body(rank, world, results, *args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
