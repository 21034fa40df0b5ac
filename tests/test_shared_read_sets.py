"""A phase's read sets on several ranks: each rank tests its own views and the ranks all-gather the results
bit-packed (`PhasePlanner.plan(share=...)`); every rank then holds the plan one process computes, mask and lists."""

from __future__ import annotations

import math

import torch

from gloo_ranks import run_ranks


def test_bits_pack_and_unpack_whatever_the_number_of_blocks():
    from odin_ns.schedule.phase_planner import pack_bits, unpack_bits

    g = torch.Generator().manual_seed(0)
    for blocks in (1, 7, 8, 9, 63, 2050):
        mask = torch.rand(5, blocks, generator=g) < 0.3
        packed = pack_bits(mask)
        assert packed.dtype == torch.uint8 and packed.shape == (5, math.ceil(blocks / 8))
        assert torch.equal(unpack_bits(packed, blocks), mask)
    assert pack_bits(torch.tensor([[True] + [False] * 8 + [True]])).tolist() == [[1, 2]]


def _scene():
    """40 blocks on a 8 x 5 grid, a ring of 12 cameras looking at its middle from outside: each sees part of it."""
    from odin_ns.schedule.predict_scenes import look_at

    from block_tables import table_of

    owner = [b % 3 for b in range(40)]
    table = table_of(owner, [10 + b % 4 for b in range(40)])
    table.count[5] = 0  # an empty block: in no read set
    xy = torch.tensor([[float(b % 8), float(b // 8)] for b in range(40)])
    table.lo = torch.cat([xy * 4, torch.zeros(40, 1)], dim=1)
    table.hi = table.lo + torch.tensor([2.0, 2.0, 3.0])
    table.max_scale = torch.full((40,), 0.2)
    angles = torch.arange(12) * (2 * math.pi / 12)
    eyes = torch.stack([14 + 30 * torch.cos(angles), 9 + 30 * torch.sin(angles), torch.full((12,), 6.0)], dim=1)
    viewmats = look_at(eyes, torch.tensor([[14.0, 9.0, 0.0]]).expand(12, 3))
    K = torch.tensor([[[160.0, 0.0, 32.0], [0.0, 160.0, 24.0], [0.0, 0.0, 1.0]]])  # narrow: part of it
    return table, lambda v: (viewmats[v:v + 1], K, 64, 48)


def _rank(rank, world, results):
    from odin_ns.runtime.transport import all_gather_rows
    from odin_ns.runtime.waits import WaitLog
    from odin_ns.schedule.phase_planner import PhasePlanner
    from odin_ns.schedule.views import ViewSchedule

    table, camera = _scene()
    planner = PhasePlanner(world, 2, ViewSchedule(12, world, 2, 7), camera)
    motion, growth = [0.5 * i for i in range(5)], [0.01 * i for i in range(5)]
    log = WaitLog(rank)
    shared = planner.plan(3, 8, table, motion, growth,
                          (rank, lambda rows: all_gather_rows(rows, [rows.shape[0]] * world, log, "phase")))
    alone = planner.plan(3, 8, table, motion, growth)
    distinct = len({tuple(m.tolist()) for m in alone.read_mask.reshape(-1, 40)})
    results[rank] = (torch.equal(shared.read_mask, alone.read_mask), shared.all_reads() == alone.all_reads(), distinct,
                     shared.read_mask[:, :, :, 5].any().item())


def test_every_rank_holds_the_plan_one_process_computes():
    results = run_ranks(_rank, 3)
    assert sorted(results) == [0, 1, 2]
    for rank, (same_mask, same_reads, distinct, empty_read) in results.items():
        assert same_mask and same_reads, rank
        assert distinct >= 6 and not empty_read  # the cameras see different parts; the empty block never
