"""Block tables for the tests of collectives: a table of given owners and sizes, and a rank's rows of a whole model
laid out in block order under it (its blocks concatenated in id order, as a rank holds them)."""

from __future__ import annotations

from typing import Sequence

import torch

from odin_ns.runtime.block_table import BlockTable


def table_of(owner: Sequence[int], count: Sequence[int]) -> BlockTable:
    B = len(count)
    return BlockTable(owner=torch.tensor(owner), count=torch.tensor(count), lo=torch.zeros(B, 3),
                      hi=torch.zeros(B, 3), max_scale=torch.zeros(B), version=torch.zeros(B, dtype=torch.int64))


def rows_of(owner: Sequence[int], count: Sequence[int], rank: int) -> torch.Tensor:
    """The whole model's rows `rank` holds, in the order it holds them."""
    starts = [sum(count[:b]) for b in range(len(count))]
    rows = [torch.arange(starts[b], starts[b] + count[b]) for b in range(len(count)) if owner[b] == rank]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
