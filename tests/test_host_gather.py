"""A checkpoint's gather of the whole model (`ShardedGaussians.gather_to(..., to_host=True)`; real gloo processes):
rank 0 gets every block's rows in block order, the same as the gather on the device, whatever the ownership (a
rank's blocks between another's, an empty block, a rank that owns nothing), and takes them one rank at a time
(each transfer receives from one rank, and what it received is copied to host memory before the next), so that
its device never holds the whole model."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from gloo_ranks import run_ranks

from odin_ns.runtime import sharded
from odin_ns.runtime.block_table import BlockTable
from odin_ns.runtime.sharded import ShardedGaussians
from odin_ns.runtime.waits import WaitLog

OWNER = [2, 0, 2, 0, 1, 2, 2]  # rank 3 owns nothing
COUNT = [5, 0, 7, 3, 4, 6, 2]
WIDTH = 9


def _rank(rank: int, world: int, results) -> None:
    whole = torch.arange(sum(COUNT) * WIDTH, dtype=torch.float32).reshape(-1, WIDTH)
    starts = [sum(COUNT[:b]) for b in range(len(COUNT))]
    mine = [whole[starts[b]:starts[b] + COUNT[b]] for b in range(len(COUNT)) if OWNER[b] == rank]
    rows = torch.cat(mine) if mine else whole[:0]
    B = len(COUNT)
    table = BlockTable(owner=torch.tensor(OWNER), count=torch.tensor(COUNT), lo=torch.zeros(B, 3),
                       hi=torch.zeros(B, 3), max_scale=torch.zeros(B), version=torch.zeros(B, dtype=torch.int64))
    gatherer = ShardedGaussians(SimpleNamespace(rank=rank, world_size=world), table, 15, torch.device("cpu"),
                                WaitLog(rank))
    peers_per_transfer = []
    exchange = sharded.exchange

    def counted(sends, shapes, *args):
        peers_per_transfer.append(len(shapes))
        return exchange(sends, shapes, *args)

    sharded.exchange = counted
    on_host = gatherer.gather_to(0, rows, to_host=True)
    host_transfers = list(peers_per_transfer)
    on_device = gatherer.gather_to(0, rows)
    if rank == 0:
        results["host"] = torch.equal(on_host, whole)
        results["device"] = torch.equal(on_device, whole)
        results["transfers"] = host_transfers
    else:
        results[f"rank {rank}"] = on_host is None and on_device is None


def test_a_checkpoints_gather_takes_one_rank_at_a_time_into_host_memory():
    results = run_ranks(_rank, 4)
    assert results["host"] and results["device"]
    assert results["transfers"] == [1, 1], results["transfers"]  # ranks 1 and 2, each alone; rank 3 sends nothing
    assert all(results[f"rank {r}"] for r in (1, 2, 3))
