"""This rank's share of the Gaussians: the blocks it owns, replicas of remote blocks it reads, and the traffic.

Owned blocks live in the model's Parameters (concatenated in block-id order) with their optimizer state; a
replica is a plain copy of a remote block at a known version. Every rank keeps the same `held[q, b]` matrix (the
version of block b that rank q holds, -1 for none), updated by the same rules from the same replicated data, so
each side of a transfer knows what moves without a request: a replica whose version has not changed is never
sent again, and a replica that went stale is dropped.

Messages are packed rows, one per Gaussian: the parameters (`pack_params`) for fetches, the gradients plus the
densification statistics (`GRAD_EXTRA`) for contributions sent to owners.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

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


def pack_params(params: Dict[str, torch.Tensor]) -> torch.Tensor:
    """[n, D] rows of the six Gaussian parameters (n may be 0: a rank can own no block)."""
    return torch.cat([params[name].detach().flatten(1) for name in PARAM_NAMES], dim=1)


def unpack_params(rows: torch.Tensor, num_rest: int) -> Dict[str, torch.Tensor]:
    """Inverse of `pack_params` (views into `rows`)."""
    out, col, n = {}, 0, rows.shape[0]
    for name, width in param_widths(num_rest).items():
        block = rows[:, col:col + width]
        if name == "features_rest":
            block = block.reshape(n, num_rest, 3)
        out[name] = block
        col += width
    return out


class ShardedGaussians:
    """Replicas and transfers of one rank; the owned tensors are passed in (they belong to the model)."""

    def __init__(self, env: DistEnv, table: BlockTable, num_rest: int, device: torch.device, log: WaitLog):
        self.env = env
        self.table = table
        self.num_rest = num_rest
        self.width = sum(param_widths(num_rest).values())
        self.device = device
        self.log = log
        self.replicas: Dict[int, torch.Tensor] = {}  # block id -> packed rows [count, D]
        self.held = torch.full((env.world_size, table.num_blocks), -1, dtype=torch.int64)

    # ---- replicas -------------------------------------------------------------------------------------------

    def _needed(self, rank: int, reads: Sequence[torch.Tensor]) -> List[int]:
        """Remote blocks rank `rank` reads this step and does not hold at their current version (ascending)."""
        if not reads:
            return []
        ids = torch.unique(torch.cat(list(reads)))
        ids = ids[self.table.owner[ids] != rank]
        stale = self.held[rank, ids] != self.table.version[ids]
        return ids[stale].tolist()

    def fetch(self, reads: Sequence[Sequence[torch.Tensor]], owned_rows: torch.Tensor, cause: str = "fetch") -> None:
        """Bring every rank's replicas up to date for its reads this step (`reads[q]`: its views' block ids).

        `owned_rows`: this rank's owned Gaussians, packed. Owners send, readers receive, all in one exchange.
        """
        me, table = self.env.rank, self.table
        ranges = table.owned_ranges(me)
        needed = [self._needed(q, reads[q]) for q in range(self.env.world_size)]
        sends, shapes = {}, {}
        for q, blocks in enumerate(needed):
            if q == me:
                continue
            mine = [b for b in blocks if int(table.owner[b]) == me]
            if mine:
                sends[q] = torch.cat([owned_rows[ranges[b][0]:ranges[b][1]] for b in mine])
        incoming: Dict[int, List[int]] = {}
        for b in needed[me]:
            incoming.setdefault(int(table.owner[b]), []).append(b)
        for p, blocks in incoming.items():
            shapes[p] = (int(table.count[blocks].sum()), self.width)
        received = exchange(sends, shapes, owned_rows.dtype, self.device, self.log, cause)
        for p, blocks in incoming.items():
            start = 0
            for b in blocks:
                n = int(table.count[b])
                self.replicas[b] = received[p][start:start + n]
                start += n
        for q, blocks in enumerate(needed):
            if blocks:
                self.held[q, blocks] = table.version[blocks]

    def drop_stale(self) -> None:
        """Forget replicas whose block has a newer version (every rank applies the same rule to `held`)."""
        stale = (self.held >= 0) & (self.held != self.table.version[None, :])
        self.held[stale] = -1
        for b in [b for b in self.replicas if bool(stale[self.env.rank, b])]:
            del self.replicas[b]

    def drop_all(self) -> None:
        self.replicas.clear()
        self.held = torch.full((self.env.world_size, self.table.num_blocks), -1, dtype=torch.int64)

    def num_replicated(self) -> int:
        return sum(int(r.shape[0]) for r in self.replicas.values())

    # ---- what a view renders ------------------------------------------------------------------------------

    def render_rows(self, block_ids: torch.Tensor, owned_rows: torch.Tensor) -> torch.Tensor:
        """Packed rows of the blocks `block_ids` (ascending), owned or replicated, in block order."""
        ranges = self.table.owned_ranges(self.env.rank)
        parts = []
        for b in block_ids.tolist():
            if b in ranges:
                parts.append(owned_rows[ranges[b][0]:ranges[b][1]])
            else:
                parts.append(self.replicas[b])
        if not parts:
            return owned_rows[:0]
        return torch.cat(parts)

    # ---- gradients to owners ----------------------------------------------------------------------------

    def reduce_to_owners(self, reads: Sequence[Sequence[torch.Tensor]],
                         mine: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, List[Tuple[int, int, torch.Tensor]]]:
        """Send each view's contribution rows to the blocks' owners; return this owner's contributions in order.

        `reads[q][j]`: block ids of rank q's view j; `mine[j]`: this rank's rows [sum counts, D + GRAD_EXTRA] for
        its view j, blocks in `reads[me][j]` order. Returns (`rows` of every contribution this rank owns, and a
        list of (rank, view slot, owned row index) in the reference order: rank order, then view order).
        """
        me, table = self.env.rank, self.table
        width = self.width + GRAD_EXTRA
        ranges = table.owned_ranges(me)
        sends: Dict[int, List[torch.Tensor]] = {}
        for j, ids in enumerate(reads[me]):
            start = 0
            for b in ids.tolist():
                n = int(table.count[b])
                owner = int(table.owner[b])
                if owner != me:
                    sends.setdefault(owner, []).append(mine[j][start:start + n])
                start += n
        shapes = {}
        for q in range(self.env.world_size):
            if q == me:
                continue
            rows = sum(int(table.count[b]) for ids in reads[q] for b in ids.tolist() if int(table.owner[b]) == me)
            if rows:
                shapes[q] = (rows, width)
        dtype = mine[0].dtype if mine else torch.float32
        received = exchange({p: torch.cat(v) for p, v in sends.items()}, shapes, dtype, self.device, self.log,
                            "transfer")
        contributions: List[Tuple[int, int, torch.Tensor]] = []
        pieces: List[torch.Tensor] = []
        for q in range(self.env.world_size):
            cursor = 0  # position in what rank q sent this owner
            for j, ids in enumerate(reads[q]):
                start = 0  # position in rank q's rows of view j
                for b in ids.tolist():
                    n = int(table.count[b])
                    if int(table.owner[b]) == me:
                        if q == me:
                            pieces.append(mine[j][start:start + n])
                        else:
                            pieces.append(received[q][cursor:cursor + n])
                            cursor += n
                        contributions.append((q, j, torch.arange(ranges[b][0], ranges[b][0] + n)))
                    start += n
        rows = torch.cat(pieces) if pieces else torch.zeros((0, width), dtype=dtype, device=self.device)
        return rows, contributions

    # ---- the whole model on one rank -----------------------------------------------------------------------

    def gather_to(self, root: int, owned_rows: torch.Tensor) -> Optional[torch.Tensor]:
        """All blocks' packed rows on `root`, in block order (collective: every rank calls it)."""
        me, table = self.env.rank, self.table
        sends = {root: owned_rows} if me != root and owned_rows.shape[0] else {}
        shapes = {}
        if me == root:
            for p in range(self.env.world_size):
                n = table.num_owned_gaussians(p)
                if p != root and n:
                    shapes[p] = (n, owned_rows.shape[1])
        received = exchange(sends, shapes, owned_rows.dtype, self.device, self.log, "gather")
        if me != root:
            return None
        parts, cursors = [], {p: 0 for p in range(self.env.world_size)}
        for b in range(table.num_blocks):
            p, n = int(table.owner[b]), int(table.count[b])
            source = owned_rows if p == root else received[p]
            parts.append(source[cursors[p]:cursors[p] + n])
            cursors[p] += n
        return torch.cat(parts) if parts else owned_rows[:0]
