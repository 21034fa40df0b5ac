"""The test of a step's moved rows against the bounds their phase was planned with (runtime/row_bounds.py) decides
as the direct comparisons do, row by row, at the edges of the bounds too: a mean one float32 step either side of
lo - motion and hi + motion, a largest scale either side of a float64 bound, NaN. A row the table lets through that
the direct test would not is a read set the plan did not complete."""

import math

import torch

from odin_ns.runtime.row_bounds import RowBounds

B = 3000  # one row per block: the blocks outside are the rows outside


def _direct(lo, hi, max_scale, motion, growth, row_block, i, rows, means, log_scales):
    """The bounds test written directly (float32 means against float32 bounds, scales in float64)."""
    blocks = row_block[rows]
    m = means[rows]
    scale = torch.exp(log_scales[rows]).amax(dim=1)
    inside = ((m >= lo[blocks] - motion[i]).all(dim=1) & (m <= hi[blocks] + motion[i]).all(dim=1)
              & (scale.double() <= max_scale[blocks].double() * math.exp(growth[i])))
    return sorted(set(blocks[~inside].tolist()))


def _edge(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x, one float32 step below or above it, or x itself, at random."""
    pick = torch.randint(0, 3, x.shape, generator=g)
    down = torch.nextafter(x, torch.full_like(x, -math.inf))
    up = torch.nextafter(x, torch.full_like(x, math.inf))
    return torch.where(pick == 0, down, torch.where(pick == 1, up, x))


def test_table_decides_as_the_direct_comparisons_at_the_edges():
    g = torch.Generator().manual_seed(3)
    motion = [0.0, 0.0137, 0.1 / 3, 0.25]  # not float32 numbers: their rounding must match the direct test's
    growth = [0.0, 0.011, 0.07, 1 / 7]
    row_block = torch.randperm(B, generator=g)
    log_scales = torch.randn(B, 3, generator=g) * 0.5 - 3.0
    rows = torch.arange(B)
    for i in range(len(motion)):
        # each row's block bounds put at the row's own values, so that most rows lie on an edge
        means = torch.randn(B, 3, generator=g)
        side = torch.rand(B, generator=g) < 0.5
        lo_i, hi_i = torch.empty(B, 3), torch.empty(B, 3)
        lo_i[row_block], hi_i[row_block] = means - 0.5, means + 0.5
        lo_i[row_block[side]] = _edge(means[side], g) + motion[i]
        hi_i[row_block[~side]] = _edge(means[~side], g) - motion[i]
        largest = torch.exp(log_scales).amax(dim=1).double()
        max_scale = (largest / math.exp(growth[i])).float()[torch.argsort(row_block)]
        max_scale = _edge(max_scale, g)
        means[::97, 1] = math.nan
        log_scales_i = log_scales.clone()
        log_scales_i[::89, 2] = math.nan
        table = RowBounds(lo_i, hi_i, max_scale, motion, growth, row_block)
        got = table.blocks_outside(i, rows, means, log_scales_i)
        want = _direct(lo_i, hi_i, max_scale, motion, growth, row_block, i, rows, means, log_scales_i)
        assert got == want, (i, len(got), len(want), sorted(set(got) ^ set(want))[:5])
        assert table.blocks_outside(i, None, means, log_scales_i) == want  # every row, as they lie
        assert 0.2 * B < len(want) < 0.95 * B, len(want)  # both sides of the edges were tried


def test_rows_inside_and_a_subset_of_rows():
    g = torch.Generator().manual_seed(4)
    lo = torch.randn(40, 3, generator=g)
    hi = lo + 1.0
    row_block = torch.arange(40).repeat_interleave(5)
    means = lo[row_block] + 0.5
    log_scales = torch.full((200, 3), -4.0)
    max_scale = torch.full((40,), 1.0)
    table = RowBounds(lo, hi, max_scale, [0.0, 0.01], [0.0, 0.0], row_block)
    rows = torch.tensor([3, 17, 101, 199])
    assert table.blocks_outside(1, rows, means, log_scales) == []
    means[17, 0] = hi[3, 0] + 0.02  # block 3's row: beyond hi + motion
    log_scales[199, 1] = 0.5  # block 39's: exp(0.5) > 1
    means[150, 2] = -1e9  # outside, but not among the rows tested
    assert table.blocks_outside(1, rows, means, log_scales) == [3, 39]
    assert table.blocks_outside(1, torch.zeros(0, dtype=torch.int64), means, log_scales) == []


def test_check_brings_the_evidence_back_with_the_verdict():
    """`check`'s one host read returns values given beside the test (throughput-first's evidence), bit for bit,
    whatever the verdict, and the same blocks as `blocks_outside`."""
    g = torch.Generator().manual_seed(5)
    lo = torch.randn(40, 3, generator=g)
    row_block = torch.arange(40).repeat_interleave(5)
    means, log_scales = lo[row_block] + 0.5, torch.full((200, 3), -4.0)
    table = RowBounds(lo, lo + 1.0, torch.full((40,), 1.0), [0.0, 0.01], [0.0, 0.0], row_block)
    rows = torch.tensor([3, 17, 101, 199])
    also = torch.tensor([0.0, 1e-300, 2.5, math.inf, 1 / 3], dtype=torch.float64)
    for outside in ([], [3]):
        if outside:
            means[17, 0] = 1e9
        blocks, values = table.check(1, rows, means, log_scales, also=also)
        assert blocks == outside == table.blocks_outside(1, rows, means, log_scales)
        assert torch.equal(torch.tensor(values, dtype=torch.float64), also)
    assert table.check(1, rows, means, log_scales) == (outside, None)
