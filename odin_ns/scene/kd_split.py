"""Compact blocks: a balanced k-d split of the Gaussians' means into leaves of given sizes.

Runs of Morton order jump wherever the curve crosses a large octree cell, so a run of a few hundred Gaussians
can span half a city and every view then reads it. Splitting space directly keeps every block compact: the
points are cut in two along the axis on which they extend most, at the rank that gives each side the total of
its leaves, recursively. Leaves come out in depth-first order, so consecutive blocks are neighbours in space
(what a contiguous cut of the blocks into ranks relies on). Ties are broken by row index (a stable sort), so
every rank derives the same blocks from the same means. Written here: no library at hand partitions a point set
into leaves of prescribed sizes (scipy's k-d trees choose their own leaf sizes and do not expose them).
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor


def kd_order(means: Tensor, sizes: Sequence[int]) -> Tensor:
    """A permutation of the rows of `means` [N, 3] whose consecutive runs of `sizes` are the k-d leaves."""
    sizes = [int(s) for s in sizes]
    n = int(means.shape[0])
    if sum(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"leaf sizes must be non-negative and sum to the {n} rows, got a sum of {sum(sizes)}")
    points = means.detach().cpu().to(torch.float64)
    out: List[Tensor] = []
    stack = [(torch.arange(n, dtype=torch.int64), sizes)]
    while stack:  # depth first, left before right: leaves in spatial order
        idx, leaf_sizes = stack.pop()
        if len(leaf_sizes) == 1 or idx.numel() == 0:
            out.append(idx)
            continue
        pts = points[idx]
        axis = int(torch.argmax(pts.amax(dim=0) - pts.amin(dim=0)))
        half = len(leaf_sizes) // 2
        n_left = sum(leaf_sizes[:half])
        ranked = idx[torch.sort(pts[:, axis], stable=True).indices]
        stack.append((ranked[n_left:], leaf_sizes[half:]))
        stack.append((ranked[:n_left], leaf_sizes[:half]))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def leaf_sizes(n: int, block_size: int) -> List[int]:
    """ceil(n / block_size) near-equal leaf sizes (larger ones first), none above block_size."""
    k = max(1, -(-n // block_size))
    return [n // k + (1 if i < n % k else 0) for i in range(k)]
