"""The plan of a scene given as geometry alone (points and cameras, no images): what the prediction replays for
scenes that do not train here (a real point cloud with an orbit of cameras, a generated city of millions of
Gaussians and thousands of views).

It makes what the runtime makes at start-up and at each phase start, with the same functions: blocks cut from the
points and their owners (`cut_blocks`), the view order (`view_schedule`), then one `PhasePlan` per phase of
`phase_length` steps from the planner every rank plans with (`PhasePlanner`), each timed as a rank makes it
(`planning_time`). The optimizer's motion bound is left
out (no optimizer runs): read sets are those of the initial model.
"""

from __future__ import annotations

from typing import Optional

import torch

from odin_ns.runtime.block_table import cut_blocks
from odin_ns.scene.read_sets import blocks_in_views
from odin_ns.schedule.phase_planner import NEAR_PLANE, PhasePlanner, view_schedule
from odin_ns.schedule.planning_time import plan_timed
from odin_ns.schedule.preview import Preview
from odin_ns.schedule.visibility import view_gaussians, visible_share



def preview_from_geometry(means: torch.Tensor, scales: torch.Tensor, viewmats: torch.Tensor, Ks: torch.Tensor,
                          width: int, height: int, ranks: int, steps: int, block_size: int, micro_batch: int = 1,
                          phase_length: int = 25, seed: int = 42, view_order: str = "odin",
                          pixels: Optional[int] = None) -> Preview:
    """Plans of the first `steps` steps on `ranks` ranks. `scales`: [N, 3] (not log); `viewmats` [V, 4, 4]
    world-to-camera, `Ks` [V, 3, 3] at `width` x `height`; `pixels`: the render resolution the costs assume
    (default width x height)."""
    order, table = cut_blocks(means, scales, block_size, "kd", ranks)
    counts, lo, hi = table.count, table.lo, table.hi
    V = viewmats.shape[0]
    mask = blocks_in_views(lo, hi, viewmats, Ks, torch.full((V,), width), torch.full((V,), height), table.max_scale,
                           torch.zeros(V), torch.zeros(V), near=NEAR_PLANE) & (counts > 0)[None, :]
    cameras = [(viewmats[v:v + 1], Ks[v:v + 1], width, height) for v in range(V)]
    visible = visible_share(means[order], counts, viewmats, Ks, width, height)
    schedule = view_schedule(view_order, lambda: mask, counts, V, ranks, micro_batch, seed,  # one batched test
                             lambda: view_gaussians(visible, counts))
    planner = PhasePlanner(ranks, micro_batch, schedule, cameras.__getitem__)
    timed = plan_timed(planner, [(start, min(start + phase_length, steps), (), ())
                                 for start in range(0, steps, phase_length)], table)
    filled = counts > 0
    diag = float(torch.linalg.norm(hi[filled].amax(0) - lo[filled].amin(0))) or 1.0
    extent = [float(torch.linalg.norm(hi[b] - lo[b])) / diag if filled[b] else 0.0 for b in range(len(counts))]
    gaussians = view_gaussians(mask, counts)
    return Preview(ranks=ranks, plans=timed.plans, gaussians_read=gaussians, pixels=[pixels or width * height] * V,
                   block_counts=counts.tolist(), block_extent=extent, num_views=V, visible=visible,
                   planning_s=timed.planning_s, gather_bytes=timed.gather_bytes)
