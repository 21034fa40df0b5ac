"""What the live viewer draws on several ranks: a snapshot of the model on rank 0, within a bound.

nerfstudio's viewer renders on rank 0 at any moment, beside the steps, so it draws a copy of the model gathered at
the trainer's refreshes (`OdinTrainer._refresh_viewer`). A copy of the whole model on rank 0's device is what
sharding exists to avoid for a scene no device holds: above `--pipeline.viewer-max-gaussians` each rank sends its
most opaque Gaussians, its share of the bound by its share of the model, and the viewer draws those (the panel says
how many of how many). The bound by default (0) is a sixteenth of a GPU's memory in packed rows (a refresh holds
about four copies at its peak: the parts received, their concatenation, the parameters made contiguous, the
previous copy the viewer still draws), and none on CPU ranks, whose device is the host's memory; the ranks agree on
the smallest of theirs. Below the bound the snapshot is the whole model in block order, as before.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from odin_ns.runtime.projection_memory import device_memory
from odin_ns.runtime.sharded import PARAM_NAMES, pack_params, row_width, unpack_params
from odin_ns.runtime.transport import comm_device, exchange

VIEWER_SHARE = 1 / 16  # of a GPU's memory, the default bound's copy of packed rows (see the module docstring)


def viewer_limit(configured: int, device: torch.device, num_rest: int) -> Optional[int]:
    """The most Gaussians a snapshot holds (None: no bound): `configured`, or for 0 a sixteenth of a GPU's memory
    in packed rows (none on the CPU). A bound from GPU memory is collective on several ranks: the smallest of the
    ranks' (GPUs may differ; the option and the device type are every rank's same)."""
    if configured > 0:
        return configured
    memory = device_memory(device)
    if memory is None:
        return None
    limit = int(VIEWER_SHARE * memory) // (4 * row_width(num_rest))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return limit
    agreed = torch.tensor([limit], dtype=torch.int64, device=comm_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def shares(limit: int, owned: Tuple[int, ...]) -> Tuple[int, ...]:
    """Each rank's rows in a snapshot of `limit` Gaussians (fewer than the model's): its share of the bound by its
    share of the model, rounded down, and what the rounding left one more each to the ranks it took most from
    (ties to the lower rank), never more than a rank owns; every rank computes the same from the table."""
    total = sum(owned)
    base = [limit * n // total if total else 0 for n in owned]
    left = limit - sum(base)
    order = sorted(range(len(owned)), key=lambda r: (-(limit * owned[r] % total) if total else 0, r))
    for r in order:
        if left == 0:
            break
        if base[r] < owned[r]:
            base[r] += 1
            left -= 1
    return tuple(base)


def gather_for_viewer(engine, limit: Optional[int]
                      ) -> Tuple[Optional[Dict[str, torch.Tensor]], Optional[torch.Tensor], int, int]:
    """Collective. Rank 0 gets (the snapshot's parameters, each row's owning rank, the Gaussians shown, the
    model's); the other ranks (None, None, shown, total)."""
    table, env = engine.table, engine.env
    owned = tuple(table.num_owned_gaussians(r) for r in range(env.world_size))
    total = sum(owned)
    if limit is None or total <= limit:
        snapshot = engine.gather_full()
        owners = torch.repeat_interleave(table.owner, table.count) if env.rank == 0 else None
        return snapshot, owners, total, total
    counts = shares(limit, owned)
    params = engine.model.gauss_params
    keep = torch.topk(params["opacities"].detach().reshape(-1), counts[env.rank]).indices.sort().values
    rows = pack_params({n: params[n].detach().index_select(0, keep) for n in PARAM_NAMES})
    shapes = {r: (n, rows.shape[1]) for r, n in enumerate(counts) if r != 0 and n} if env.rank == 0 else {}
    received = exchange({0: rows} if env.rank != 0 and counts[env.rank] else {}, shapes, rows.dtype, engine.device,
                        engine.log, "gather")
    shown = sum(counts)
    if env.rank != 0:
        return None, None, shown, total
    parts = [rows] + [received[r] for r in sorted(received)]
    snapshot = {n: t.contiguous() for n, t in unpack_params(torch.cat(parts), engine.num_rest).items()}
    ranks = [0] + sorted(received)
    owners = torch.repeat_interleave(torch.tensor(ranks), torch.tensor([counts[r] for r in ranks]))
    return snapshot, owners, shown, total
