"""Throughput-first's evidence on the host: a header carries each block's value as the int64 word of its float64
bits, and the reader decides with the very floats the owner decided with (its replay of the reader's decisions)."""

import math
import struct

import torch

from odin_ns.runtime.admission import block_sums, evidence_from_wire, evidence_to_wire, largest


def test_evidence_crosses_the_wire_bit_for_bit():
    values = [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1 / 3, 0.05, 1e300, math.inf, math.nan]
    g = torch.Generator().manual_seed(3)
    values += (torch.rand(200, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -300, 300, (200,), generator=g).double()).tolist()
    words = evidence_to_wire(values)
    assert words.dtype == torch.int64 and words.shape == (len(values),)
    back = evidence_from_wire(words.tolist())  # as the reader gets it: the header's one host read, a list of ints
    assert [struct.pack("d", v) for v in back] == [struct.pack("d", v) for v in values]
    assert evidence_from_wire([]) == []


def test_largest_of_the_blocks_read():
    rel = [0.5, math.inf, 0.25, 2.0]
    assert largest(rel, [0, 2]) == 0.5
    assert largest(rel, [2, 3]) == 2.0
    assert largest(rel, [1]) == math.inf  # unknown size: never admitted behind
    assert largest(rel, []) == 0.0


def test_a_nan_is_the_largest():
    """A NaN among the blocks read makes the largest NaN (a tensor's max does), so the read is refused."""
    rel = [0.01, math.nan, 0.5]
    assert math.isnan(largest(rel, [0, 1])) and math.isnan(largest(rel, [1, 2]))
    assert largest(rel, [0, 2]) == 0.5


def test_block_sums_per_segment_are_index_adds():
    """The sums per block as a GPU makes them (a sum per segment of the ascending rows, no atomics) are the CPU's
    `index_add_`, bit for bit, empty blocks included."""
    g = torch.Generator().manual_seed(8)
    for rows, count in ((1000, 37), (5, 9), (0, 4)):
        keys = torch.sort(torch.randint(0, count, (rows,), generator=g)).values
        values = torch.rand(rows, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
            -20, 20, (rows,), generator=g).double()
        expected = block_sums(values, keys, count)
        assert torch.equal(block_sums(values, keys, count, segmented=True), expected), rows
        assert int((expected == 0).sum()) >= count - len(set(keys.tolist()))
