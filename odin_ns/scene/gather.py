"""Per-owner shards of per-Gaussian tensors, and their bit-exact reassembly.

The canonical (global) order of Gaussians is the model's order (the order a splatfacto checkpoint stores). A shard
holds the rows of its owner's blocks (ascending block id, each block in Morton order) together with their global
row indices, so scattering every shard back by those indices rebuilds the full tensors exactly: it is only
index_select / index_copy_, no arithmetic. Works for any dict of [N, ...] tensors: splatfacto's parameters
(means [N,3], scales [N,3], quats [N,4], features_dc [N,3], features_rest [N,K,3], opacities [N,1]) as well as
optimizer moments (exp_avg, exp_avg_sq) or densification statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from odin_ns.scene.blocks import BlockLayout
from odin_ns.scene.ownership import Ownership

SPLATFACTO_KEYS = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")


@dataclass
class Shard:
    """The rows of `blocks` (global indices `rows`) of each tensor in `tensors`, owned by `rank`."""

    rank: int
    blocks: Tensor  # [k] int64 block ids, ascending
    rows: Tensor  # [n] int64 global row indices, block by block
    tensors: Dict[str, Tensor]  # name -> [n, ...]


def block_rows(layout: BlockLayout, blocks: Union[Tensor, Sequence[int], np.ndarray]) -> Tensor:
    """Global row indices [n] of `blocks`, block after block in the given order, each block in Morton order."""
    blocks = torch.as_tensor(np.asarray(blocks, dtype=np.int64)).reshape(-1)
    starts, counts = layout.offsets[blocks], layout.counts[blocks]
    total = int(counts.sum())
    # position j of the output reads order[starts[block of j] + (j - first output position of that block)]
    first = torch.cumsum(counts, 0) - counts
    pos = torch.repeat_interleave(starts - first, counts, output_size=total) + torch.arange(total)
    return layout.order[pos]


@torch.no_grad()
def gather_rows(tensors: Mapping[str, Tensor], rows: Tensor) -> Dict[str, Tensor]:
    """{name: tensor[rows]} (detached copies)."""
    return {k: v.detach().index_select(0, rows.to(v.device)) for k, v in tensors.items()}


@torch.no_grad()
def scatter_rows(out: Mapping[str, Tensor], rows: Tensor, tensors: Mapping[str, Tensor]) -> None:
    """In place: out[name][rows] = tensors[name] for every name in `tensors`."""
    for k, v in tensors.items():
        out[k].index_copy_(0, rows.to(out[k].device), v.to(out[k].device))


def shard(tensors: Mapping[str, Tensor], layout: BlockLayout, ownership: Ownership) -> List[Shard]:
    """One `Shard` per rank, with the rows of the blocks it owns."""
    if ownership.num_blocks != layout.num_blocks:
        raise ValueError("ownership and layout disagree on the number of blocks")
    for k, v in tensors.items():
        if v.shape[0] != layout.num_gaussians:
            raise ValueError(f"{k} has {v.shape[0]} rows, the layout {layout.num_gaussians}")
    shards = []
    for r in range(ownership.num_ranks):
        blocks = torch.as_tensor(ownership.blocks_of(r))
        rows = block_rows(layout, blocks)
        shards.append(Shard(r, blocks, rows, gather_rows(tensors, rows)))
    return shards


@torch.no_grad()
def reassemble(shards: Iterable[Shard], num_gaussians: int) -> Dict[str, Tensor]:
    """The full tensors in canonical order; every row must be covered by exactly one shard."""
    shards = list(shards)
    seen = torch.zeros(num_gaussians, dtype=torch.int64)
    for s in shards:
        seen.index_add_(0, s.rows, torch.ones_like(s.rows))
    if not bool((seen == 1).all()):
        raise ValueError(
            f"shards must cover each row exactly once: {int((seen == 0).sum())} missing, "
            f"{int((seen > 1).sum())} repeated"
        )
    if not shards:
        return {}
    out = {}
    for k, v in shards[0].tensors.items():
        out[k] = torch.empty((num_gaussians,) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device)
    for s in shards:
        scatter_rows(out, s.rows, s.tensors)
    return out
