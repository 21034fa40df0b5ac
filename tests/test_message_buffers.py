"""A rank's message buffers: counted while they are alive (`runtime.held_bytes`), and a gloo send's let go once
it is delivered, not at the phase's end (`runtime.send_reaper`; real gloo processes)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

from odin_ns.runtime.held_bytes import HeldBytes
from odin_ns.runtime.transport import Channels
from odin_ns.runtime.waits import WaitLog


def test_a_buffer_counts_while_it_is_alive_and_once_with_its_views():
    held = HeldBytes()
    a, b = torch.zeros(1000), torch.zeros(10, 50)
    held.hold(a)
    held.hold(a[10:20])  # a view: its storage, already held
    alias = a.detach()  # another tensor on the same storage
    held.hold(alias)
    held.hold(b)
    assert held.now == 4000 + 2000
    view = a[:5]
    del a
    assert held.now == 6000, "a view keeps its base alive"
    del view
    assert held.now == 6000, "the storage lives while a held alias does"
    del alias, b
    assert held.now == 0
    assert held.take_peak() == 6000 and held.take_peak() == 0


MESSAGES, ROWS = 3, 1000


def _rank(rank: int, world: int, results) -> None:
    side = dist.new_group([0, 1])  # kept apart from the channels' messages
    log = WaitLog(rank)
    channels = Channels(torch.device("cpu"), log)
    if rank == 0:
        channels.batch([(1, torch.full((ROWS, 10), float(k))) for k in range(MESSAGES)], [], "transfer", "G")
        results["held while undelivered"] = log.held.now  # rank 1 posts nothing before the barrier
        dist.barrier(group=side)
        ack = torch.zeros(1)
        channels.batch([], [(1, ack)], "transfer")  # rank 1 has every message when it answers
        del ack  # a received buffer counts while it is alive too
        deadline = time.monotonic() + 60
        while log.held.now and time.monotonic() < deadline:  # the sends' thread lets them go
            time.sleep(0.01)
        results["held after delivery"] = log.held.now
        channels.flush()
    else:
        dist.barrier(group=side)
        got = [torch.empty((ROWS, 10)) for _ in range(MESSAGES)]
        channels.batch([], [(0, t) for t in got], "transfer")
        results["received"] = [float(t.mean()) for t in got]
        channels.batch([(0, torch.ones(1))], [], "transfer")
        channels.flush()
    dist.barrier(group=side)


def test_a_sent_buffer_is_let_go_once_its_receiver_has_it():
    results = run_ranks(_rank, 2)
    assert results["received"] == [float(k) for k in range(MESSAGES)]
    assert results["held while undelivered"] == MESSAGES * ROWS * 10 * 4
    assert results["held after delivery"] == 0
