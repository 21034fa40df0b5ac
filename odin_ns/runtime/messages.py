"""The one codec of every per-step message: gradients (reader -> owner) and publications (owner -> reader).

Both are a fixed-size int64 header, whose length both sides derive from the plan, then (if the header announces any
row) one float32 payload of rows. Row indices travel as a float32 column (exact below 2^24 rows per message).

Gradients of step t from reader q to owner o: header = [rows of each of q's views (micro-batch entries)] + [a
mask over the six parameters and the densification statistics]; payload rows = [the row's index in o's owned rows,
the columns of the masked groups]. Only the rows of o's blocks that are not all zero travel (a Gaussian a view did
not touch contributes exact zeros, and adding zeros changes no sum), and only the parameters whose gradient is not
zero in every row (the SH coefficients above the active degree); the owner puts zeros back.

Publication of update u from owner o to reader q: header = [rows, extra blocks, a mask over the six parameters]
+ [throughput-first: each published block's evidence, float64 bits]; payload rows = [the row's index among the
message's rows (its blocks' rows in ascending block order), the columns of the masked parameters]. A block that
begins a stay in q's arena travels whole; afterwards only the rows the update changed (their changed parameters).
Blocks added to a read set after a detected miss follow as two more messages (ids, then whole rows).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

GROUPS = 6  # means, scales, quats, features_dc, features_rest, opacities


def grad_header_size(micro_batch: int, groups: int) -> int:
    return micro_batch + groups


def pub_header_size(num_blocks: int, evidence: bool) -> int:
    return 2 + GROUPS + (num_blocks if evidence else 0)


def group_columns(mask: Sequence[int], groups: Sequence[Tuple[int, int]], device) -> torch.Tensor:
    """Packed-parameter columns of the parameters set in `mask`."""
    cols: List[int] = []
    for used, (c0, c1) in zip(mask, groups):
        if used:
            cols.extend(range(c0, c1))
    return torch.tensor(cols, dtype=torch.int64, device=device)


def with_index(index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows prefixed by their index (as float32)."""
    return torch.cat([index.to(rows.dtype)[:, None], rows], dim=1)
