"""A checkpoint's gather of the whole model (`ShardedGaussians.gather_to(..., to_host=True)`; real gloo processes):
rank 0 gets every block's rows in block order, the same as the gather on the device, whatever the ownership (a
rank's blocks between another's, an empty block, a rank that owns nothing), and takes them one rank at a time
(each transfer receives from one rank, and what it received is copied to host memory and let go before the next:
the test's transport hands out buffers whose `.cpu()` copies, as a GPU's do), so that its device never holds the
whole model."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch
from block_tables import rows_of, table_of
from gloo_ranks import run_ranks

from odin_ns.runtime import sharded
from odin_ns.runtime.sharded import ShardedGaussians
from odin_ns.runtime.waits import WaitLog

OWNER = [2, 0, 2, 0, 1, 2, 2]  # rank 3 owns nothing
COUNT = [5, 0, 7, 3, 4, 6, 2]
WIDTH = 9


class OnDevice(torch.Tensor):
    """A received buffer as on a GPU: `.cpu()` copies it to host memory."""

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def _rank(rank: int, world: int, results) -> None:
    whole = torch.arange(sum(COUNT) * WIDTH, dtype=torch.float32).reshape(-1, WIDTH)
    rows, table = whole[rows_of(OWNER, COUNT, rank)], table_of(OWNER, COUNT)
    gatherer = ShardedGaussians(SimpleNamespace(rank=rank, world_size=world), table, 15, torch.device("cpu"),
                                WaitLog(rank))
    peers_per_transfer, earlier_alive, received = [], [], []
    exchange = sharded.exchange

    def counted(sends, shapes, *args):
        """The transport, its buffers made to look like a device's (their `.cpu()` a copy), and whether the
        previous transfer's buffers were still alive when this one began."""
        earlier_alive.append(any(ref() is not None for ref in received))
        peers_per_transfer.append(len(shapes))
        got = {p: t.as_subclass(OnDevice) for p, t in exchange(sends, shapes, *args).items()}
        received[:] = [weakref.ref(t) for t in got.values()]
        return got

    sharded.exchange = counted
    on_host = gatherer.gather_to(0, rows, to_host=True)
    earlier_alive.append(any(ref() is not None for ref in received))
    host_transfers, host_alive = list(peers_per_transfer), list(earlier_alive)
    on_device = gatherer.gather_to(0, rows)
    if rank == 0:
        results["host"] = torch.equal(on_host, whole)
        results["device"] = torch.equal(on_device, whole)
        results["transfers"] = host_transfers
        results["device buffers alive"] = host_alive
    else:
        results[f"rank {rank}"] = on_host is None and on_device is None


def test_a_checkpoints_gather_takes_one_rank_at_a_time_into_host_memory():
    results = run_ranks(_rank, 4)
    assert results["host"] and results["device"]
    assert results["transfers"] == [1, 1], results["transfers"]  # ranks 1 and 2, each alone; rank 3 sends nothing
    # each rank's rows copied to host memory and let go on the device before the next rank's come (and at the end)
    assert results["device buffers alive"] == [False, False, False], results["device buffers alive"]
    assert all(results[f"rank {r}"] for r in (1, 2, 3))
