"""How much of its projections an owner keeps between publishing their splats and its update
(`--pipeline.projection-memory`).

A projection kept with its graph costs its backward only at the update; one kept as splats alone is made again
there with a graph (a pair at a time), which costs another projection but holds one pair's graph instead of a
step's. Both give the same contributions bit for bit (`runtime.view_projection`), so the choice is memory against
time, and it may change from one projection to the next:
- keep: every graph, whatever it holds (one GPU's default and CPU ranks': plain training's cost);
- recompute: no graph (the least memory);
- auto on several GPUs: keep a projection's graph while the graphs kept stay within a budget (a share of the
  GPU's memory, or `--pipeline.projection-budget-mb`), and make again those beyond it: small scenes run at
  keep's speed, a scene that fills the GPUs at recompute's memory.
A projection's graph is only known once it is made; the budget is checked before, with the most bytes a projected
row's graph has held so far (a prior, `GRAPH_ROW_BYTES`, until the first is kept), so it bounds the kept graphs
to about the budget, not to the byte.
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch

# What the graph of one projected row holds on a GPU: its parameters' copy (the leaves, 59 floats at SH degree 3),
# the SH coefficients gsplat's `spherical_harmonics` saves (16 x 3) and its directions (3), and what
# `fully_fused_projection` saves beside its inputs (radii 2, conic 3, compensation 1): read from gsplat's autograd
# functions, not measured (no GPU here). The prediction prices kept graphs with it too.
GRAPH_ROW_BYTES = 4 * (59 + 48 + 3 + 6)
# auto on several GPUs: the share of a GPU's memory its kept graphs may hold (the rest: the owned rows with their
# moments, the render's own graph, the messages)
AUTO_SHARE = 0.25


def keep_budget(mode: str, budget_mb: Optional[float], gpu_memory: Optional[float], world_size: int) -> float:
    """Bytes the kept graphs may hold (`math.inf` keeps every graph, 0 none), on a GPU of `gpu_memory` bytes (None:
    a CPU rank). The prediction asks the same of its GPU model."""
    if mode == "keep":
        return math.inf
    if mode == "recompute":
        return 0.0
    if budget_mb is not None:
        return budget_mb * 1e6
    if gpu_memory is None or world_size == 1:  # the projection is a third of a render there; nothing to share
        return math.inf
    return AUTO_SHARE * gpu_memory


def device_memory(device: torch.device) -> Optional[float]:
    """A GPU's memory in bytes; None on the CPU."""
    return float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None


class ProjectionMemory:
    """Decides, projection by projection, whether its graph is kept: while the graphs kept (their leaves and saved
    tensors; the splats every projection keeps are not counted) and this one's, priced at the most a row's graph
    has held so far, stay within `budget` bytes. The first graph is priced at the prior, so it may go over by what
    the prior misses (a CPU projection's graph holds about twice a GPU's). Counts both kinds (odin_stats.json);
    the lane's thread decides while the rank's own thread reads the counts, hence the lock."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.row_bytes = float(GRAPH_ROW_BYTES)  # the most a projected row's graph held so far
        self.held = 0  # bytes of the graphs kept now
        self.kept = self.again = 0  # projections since the last `take_counts`
        self._lock = threading.Lock()

    def keep(self, rows: int) -> bool:
        """Keep the graph of a projection of `rows` rows?"""
        with self._lock:
            keep = self.budget > 0 and self.held + rows * self.row_bytes <= self.budget
            if keep:
                self.kept += 1
            else:
                self.again += 1
            return keep

    def kept_graph(self, rows: int, graph_bytes: int) -> None:
        """A graph of `rows` rows kept, holding `graph_bytes`: counted until `release`, and its price learnt."""
        with self._lock:
            self.held += graph_bytes
            if rows:
                self.row_bytes = max(self.row_bytes, graph_bytes / rows)

    def release(self, graph_bytes: int) -> None:
        with self._lock:
            self.held -= graph_bytes

    def take_counts(self) -> tuple:
        with self._lock:
            counts = (self.kept, self.again)
            self.kept = self.again = 0
            return counts
