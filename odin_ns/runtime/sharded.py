"""This rank's share of the Gaussians: packed rows, and the gather of every shard on one rank.

Owned blocks live in the model's Parameters (concatenated in block-id order) with their optimizer state. A packed
row holds one Gaussian's parameters (`pack_params`): what an owner projects from, gathers at a checkpoint and moves
at a rebalance; a contribution adds the densification statistics (`GRAD_EXTRA`) to its gradient.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from odin_ns.runtime.block_table import BlockTable
from odin_ns.runtime.dist_env import DistEnv
from odin_ns.runtime.transport import exchange
from odin_ns.runtime.waits import WaitLog

PARAM_NAMES = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")
GRAD_EXTRA = 3  # per Gaussian: screen-space gradient norm, visible (0/1), normalized radius


def param_widths(num_rest: int) -> Dict[str, int]:
    """Columns per Gaussian of each parameter in a packed row (features_rest holds num_rest SH coefficients)."""
    return {"means": 3, "scales": 3, "quats": 4, "features_dc": 3, "features_rest": 3 * num_rest, "opacities": 1}


def row_width(num_rest: int) -> int:
    """Columns of a packed row (59 at SH degree 3)."""
    return sum(param_widths(num_rest).values())


def param_columns(num_rest: int) -> Dict[str, Tuple[int, int]]:
    """[start, stop) columns of each parameter in a packed row, in `PARAM_NAMES` order."""
    out, col = {}, 0
    for name, width in param_widths(num_rest).items():
        out[name] = (col, col + width)
        col += width
    return out


def pack_params(params: Dict[str, torch.Tensor]) -> torch.Tensor:
    """[n, D] rows of the six Gaussian parameters (n may be 0: a rank can own no block)."""
    return torch.cat([params[name].detach().flatten(1) for name in PARAM_NAMES], dim=1)


def gathered_rows(params: Dict[str, torch.Tensor], rows: torch.Tensor) -> Dict[str, torch.Tensor]:
    """These rows of the six parameters, each gathered (a copy: an owner projects from it, the projection's leaves,
    where packing them first and copying them into leaves made two copies more)."""
    return {name: params[name].detach().index_select(0, rows) for name in PARAM_NAMES}


def unpack_params(rows: torch.Tensor, num_rest: int) -> Dict[str, torch.Tensor]:
    """Inverse of `pack_params` (views into `rows`)."""
    out, n = {}, rows.shape[0]
    for name, (c0, c1) in param_columns(num_rest).items():
        block = rows[:, c0:c1]
        out[name] = block.reshape(n, num_rest, 3) if name == "features_rest" else block
    return out


class ShardedGaussians:
    """The traffic of one rank that involves whole shards; the owned tensors are passed in (they belong to the
    model). The per-step messages are splats (`runtime.splat_path`)."""

    def __init__(self, env: DistEnv, table: BlockTable, num_rest: int, device: torch.device, log: WaitLog):
        self.env = env
        self.table = table
        self.num_rest = num_rest
        self.width = row_width(num_rest)
        self.device = device
        self.log = log

    # ---- the whole model on one rank -----------------------------------------------------------------------

    def gather_to(self, root: int, owned_rows: torch.Tensor, to_host: bool = False) -> Optional[torch.Tensor]:
        """All blocks' packed rows on `root`, in block order (collective: every rank calls it). `to_host`: put
        together in host memory, each rank's rows crossing to the root's device alone and copied out before the
        next rank's come, so that the root's device holds at most one other rank's rows beside its own (a
        checkpoint of a model no device could hold whole); otherwise every rank's at once, on the device."""
        me, table = self.env.rank, self.table
        width = owned_rows.shape[1]
        received = {}
        for group in ([p] for p in range(self.env.world_size)) if to_host else [range(self.env.world_size)]:
            sends = {root: owned_rows} if me != root and me in group and owned_rows.shape[0] else {}
            shapes = {p: (table.num_owned_gaussians(p), width) for p in group
                      if me == root and p != root and table.num_owned_gaussians(p)}
            if sends or shapes:
                got = exchange(sends, shapes, owned_rows.dtype, self.device, self.log, "gather")
                received.update({p: t.cpu() if to_host else t for p, t in got.items()})
                del got  # (to the host: the device's copy goes before the next rank's comes)
        if me != root:
            return None
        own = owned_rows.cpu() if to_host else owned_rows
        parts, cursors = [], {p: 0 for p in range(self.env.world_size)}
        for b in range(table.num_blocks):
            p, n = int(table.owner[b]), int(table.count[b])
            if n == 0:  # (a rank whose blocks are all empty sent nothing)
                continue
            source = own if p == root else received[p]
            parts.append(source[cursors[p]:cursors[p] + n])
            cursors[p] += n
        return torch.cat(parts) if parts else own[:0]
