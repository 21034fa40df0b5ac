"""What of each block a view sees, from the initial points: the view order's costs and the prediction's messages.

`visible_share` is a block's share of points in a view (what a view's splats and gradients carry of it);
`visible_gaussians` is a view's count of them, the cost the view order balances each step's views by (a view's
render time follows the Gaussians in its image, correlation 0.94 over the built-in city's 42 views on this
machine's CPU rasterizer, where the Gaussians of the blocks it reads follow it at 0.71). Both sample up to 64
points of each block: known before training, identical on every rank, after a resume and in the preview.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from odin_ns.schedule.phase_planner import NEAR_PLANE


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


def visible_gaussians(means: torch.Tensor, counts: torch.Tensor, cameras: Sequence[Tuple]) -> List[float]:
    """Per view: the Gaussians that project inside its image in front of it (`visible_share` times the blocks'
    counts, summed). `means` in block order, `counts` per block; `cameras` per view (viewmat [1, 4, 4],
    K [1, 3, 3], width, height), views of one size tested together; computed on the CPU (schedule data, once at
    start-up: a GPU rank's means come over once)."""
    means, counts = means.detach().cpu(), torch.as_tensor(counts).cpu()
    out = [0.0] * len(cameras)
    sizes: dict = {}
    for v, (_, _, width, height) in enumerate(cameras):
        sizes.setdefault((int(width), int(height)), []).append(v)
    for (width, height), views in sizes.items():
        share = visible_share(means, counts, torch.cat([cameras[v][0] for v in views]),
                              torch.cat([cameras[v][1] for v in views]), width, height)
        for v, g in zip(views, view_gaussians(share, counts)):
            out[v] = g
    return out


def view_gaussians(share: torch.Tensor, counts: torch.Tensor) -> List[float]:
    """Per view: its share of each block's rows ([views, blocks]: a `visible_share`, the Gaussians in its image;
    or a read mask, the Gaussians it reads) times the blocks' counts, summed."""
    return (share.double() * torch.as_tensor(counts).double()[None, :]).sum(dim=1).tolist()
