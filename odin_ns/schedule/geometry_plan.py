"""The plan of a scene given as geometry alone (points and cameras, no images): what the prediction replays for
scenes that do not train here (a real point cloud with an orbit of cameras, a generated city of millions of
Gaussians and thousands of views).

It makes what the runtime makes at start-up and at each phase start, with the same functions: blocks cut from the
points (`build_layout`), owners (`assign_contiguous`), each view's read set (`blocks_in_views`), Odin's view order
(`odin_schedule`), then one `PhasePlan` per phase of `phase_length` steps. The optimizer's motion bound is left
out (no optimizer runs): read sets are those of the initial model.
"""

from __future__ import annotations

from typing import Optional

import torch

from odin_ns.runtime.engine import NEAR_PLANE
from odin_ns.scene.blocks import block_bounds, build_layout
from odin_ns.scene.ownership import assign_contiguous
from odin_ns.scene.read_sets import blocks_in_views
from odin_ns.schedule.odin_order import odin_schedule
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.preview import Preview
from odin_ns.schedule.views import ViewSchedule



def visible_share(means: torch.Tensor, counts: torch.Tensor, viewmats: torch.Tensor, Ks: torch.Tensor, width: int,
                  height: int, samples: int = 64) -> torch.Tensor:
    """Float [views, blocks]: the share of each block's points (`means` in block order, `counts` per block) that
    project inside each view's image in front of it, from up to `samples` points of each block spread evenly
    through its run. What a view's gradients and an update's publication carry of a block: its rows in view."""
    starts = torch.cumsum(counts, 0) - counts
    k = torch.arange(samples, dtype=torch.float64)
    taken = counts.clamp(max=samples)[:, None].double()  # every point of a block smaller than `samples`
    offsets = (k[None, :] * counts[:, None].double() / taken.clamp_min(1)).long()
    valid = k[None, :] < taken
    idx = (starts[:, None] + offsets.clamp_max((counts[:, None] - 1).clamp_min(0)))[valid]
    block = torch.arange(len(counts))[:, None].expand(-1, samples)[valid]
    per_block = valid.sum(dim=1).clamp_min(1).double()
    pts = torch.cat([means[idx].double(), torch.ones(len(idx), 1, dtype=torch.float64)], dim=1)
    out = torch.zeros(viewmats.shape[0], len(counts), dtype=torch.float64)
    for v0 in range(0, viewmats.shape[0], 64):  # 64 views at a time: [64, points, 3] stays small
        cam = torch.einsum("vij,nj->vni", viewmats[v0:v0 + 64].double(), pts)[..., :3]
        K = Ks[v0:v0 + 64].double()
        z = cam[..., 2]
        px = K[:, None, 0, 0] * cam[..., 0] / z.clamp_min(1e-9) + K[:, None, 0, 2]
        py = K[:, None, 1, 1] * cam[..., 1] / z.clamp_min(1e-9) + K[:, None, 1, 2]
        seen = (z > NEAR_PLANE) & (px >= 0) & (px < width) & (py >= 0) & (py < height)
        out[v0:v0 + 64] = torch.zeros(seen.shape[0], len(counts), dtype=torch.float64).index_add_(
            1, block, seen.double()) / per_block
    return out.float()


def preview_from_geometry(means: torch.Tensor, scales: torch.Tensor, viewmats: torch.Tensor, Ks: torch.Tensor,
                          width: int, height: int, ranks: int, steps: int, block_size: int, micro_batch: int = 1,
                          phase_length: int = 25, seed: int = 42, view_order: str = "odin",
                          pixels: Optional[int] = None) -> Preview:
    """Plans of the first `steps` steps on `ranks` ranks. `scales`: [N, 3] (not log); `viewmats` [V, 4, 4]
    world-to-camera, `Ks` [V, 3, 3] at `width` x `height`; `pixels`: the render resolution the costs assume
    (default width x height)."""
    layout = build_layout(means, scales, block_size=block_size, cut="kd")
    order, counts = layout.order, layout.counts.clone()
    block_of = torch.repeat_interleave(torch.arange(len(counts)), counts)
    lo, hi, _, _, max_scale = block_bounds(means[order], scales[order], block_of, len(counts))
    owner = torch.as_tensor(assign_contiguous(counts.numpy().astype(float), ranks).owner, dtype=torch.int64)
    V = viewmats.shape[0]
    mask = blocks_in_views(lo, hi, viewmats, Ks, torch.full((V,), width), torch.full((V,), height), max_scale,
                           torch.zeros(V), torch.zeros(V), near=NEAR_PLANE) & (counts > 0)[None, :]
    if view_order == "odin":
        schedule = odin_schedule(mask, counts, ranks, micro_batch, seed)
    else:
        schedule = ViewSchedule(num_views=V, num_ranks=ranks, micro_batch=micro_batch, seed=seed)
    reads_of = [torch.nonzero(m).flatten().tolist() for m in mask]
    plans, start = [], 0
    while start < steps:
        stop = min(start + phase_length, steps)
        views = [schedule.global_views(step) for step in range(start, stop)]
        reads = [[[reads_of[v] for v in rank_views] for rank_views in step_views] for step_views in views]
        plans.append(PhasePlan(start=start, stop=stop, num_ranks=ranks, owner=owner.tolist(), views=views,
                               reads=reads, counts=counts.tolist()))
        start = stop
    filled = counts > 0
    diag = float(torch.linalg.norm(hi[filled].amax(0) - lo[filled].amin(0))) or 1.0
    extent = [float(torch.linalg.norm(hi[b] - lo[b])) / diag if filled[b] else 0.0 for b in range(len(counts))]
    gaussians = (mask.to(torch.float64) * counts.to(torch.float64)[None, :]).sum(dim=1).tolist()
    return Preview(ranks=ranks, plans=plans, gaussians_read=gaussians, pixels=[pixels or width * height] * V,
                   block_counts=counts.tolist(), block_extent=extent, num_views=V,
                   visible=visible_share(means[order], counts, viewmats, Ks, width, height))
