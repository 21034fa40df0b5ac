"""Scenes the prediction replays that do not train here, as geometry: points, their scales, cameras.

- garden: the real sparse point cloud of Mip-NeRF 360's garden (139k points, `../shared/data/garden_points.npz`)
  with an orbit of cameras like the dataset's own (its three cameras circle the table at about 1.1 units, 0.5
  above it, looking slightly down at the centre; the dataset has 185 photos), at the resolution gsplat's
  benchmarks train it (1297x840, a quarter of the photos').
- matrixcity: a generated city of the order of MatrixCity's small city (2.7 km^2, aerial views): buildings on a
  street grid over 1.6 x 1.6 km with points on roofs, facades and the ground, and aerial cameras on a grid at
  150-250 m looking down at 45-60 degrees with random headings, 1920x1080 at a 60-degree field of view. Each view
  sees a few percent of the city: the case Odin's regions exist for.
Points stand for Gaussians: the prediction scales their counts to the Gaussians it is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch

Geometry = Dict[str, object]  # means [N,3], scales [N,3], viewmats [V,4,4], Ks [V,3,3], width, height


def look_at(eyes: torch.Tensor, targets: torch.Tensor, up=(0.0, 0.0, 1.0)) -> torch.Tensor:
    """[V, 4, 4] OpenCV world-to-camera matrices (x right, y down, z forward) of cameras at `eyes` looking at
    `targets`, with `up` up."""
    forward = torch.nn.functional.normalize(targets - eyes, dim=1)
    right = torch.nn.functional.normalize(torch.cross(forward, torch.tensor(up).expand_as(forward), dim=1), dim=1)
    down = torch.cross(forward, right, dim=1)
    R = torch.stack([right, down, forward], dim=1)  # rows: camera axes in world coordinates
    viewmats = torch.zeros(eyes.shape[0], 4, 4)
    viewmats[:, :3, :3] = R
    viewmats[:, :3, 3] = -(R @ eyes[:, :, None])[:, :, 0]
    viewmats[:, 3, 3] = 1.0
    return viewmats


def _intrinsics(count: int, width: int, height: int, focal: float) -> torch.Tensor:
    K = torch.tensor([[focal, 0.0, width / 2], [0.0, focal, height / 2], [0.0, 0.0, 1.0]])
    return K.expand(count, 3, 3).clone()


def _spacing_scales(means: torch.Tensor) -> torch.Tensor:
    """An isotropic scale per point: the mean spacing of the points in the box holding 90% of them."""
    lo, hi = torch.quantile(means, 0.05, dim=0), torch.quantile(means, 0.95, dim=0)
    spacing = float(torch.prod((hi - lo).clamp_min(1e-6)) / means.shape[0]) ** (1 / 3)
    return torch.full_like(means, spacing)


def garden(path: Path, views: int = 185) -> Geometry:
    data = np.load(path)
    means = torch.as_tensor(data["means3d"], dtype=torch.float32)
    angles = torch.arange(views) * (2 * math.pi / views)
    eyes = torch.stack([1.1 * torch.cos(angles), 1.1 * torch.sin(angles), torch.full((views,), 0.5)], dim=1)
    width, height = 1297, 840
    focal = float(data["Ks"][0][0, 0]) * width / int(data["width"])
    return {"means": means, "scales": _spacing_scales(means), "viewmats": look_at(eyes, torch.zeros(views, 3)),
            "Ks": _intrinsics(views, width, height, focal), "width": width, "height": height}


def matrix_city(points: int = 2_000_000, views: int = 4000, seed: int = 0) -> Geometry:
    g = torch.Generator().manual_seed(seed)
    size, lot = 1600.0, 40.0  # metres: the city's side, one building lot (street included)
    lots = int(size // lot)
    heights = 10 + 70 * torch.rand(lots, lots, generator=g) ** 2  # most buildings low, a few towers
    footprint = 0.7 * lot
    # a third of the points on the ground, the rest on the buildings (roofs and facades, by area)
    n_ground = points // 3
    ground = torch.cat([torch.rand(n_ground, 2, generator=g) * size, torch.zeros(n_ground, 1)], dim=1)
    n_build = points - n_ground
    ij = torch.randint(0, lots, (n_build, 2), generator=g)
    h = heights[ij[:, 0], ij[:, 1]]
    u = torch.rand(n_build, 3, generator=g)
    on_roof = u[:, 2] < footprint / (footprint + 4 * h)
    corner = ij.float() * lot + (lot - footprint) / 2
    side = torch.randint(0, 4, (n_build,), generator=g)
    t = u[:, 0] * footprint
    facade_xy = torch.stack([torch.where(side % 2 == 0, t, torch.where(side == 1, footprint, 0.0).expand_as(t)),
                             torch.where(side % 2 == 1, t, torch.where(side == 2, footprint, 0.0).expand_as(t))],
                            dim=1)
    xy = torch.where(on_roof[:, None], u[:, :2] * footprint, facade_xy) + corner
    z = torch.where(on_roof, h, u[:, 1] * h)
    means = torch.cat([ground, torch.cat([xy, z[:, None]], dim=1)])
    side_n = math.isqrt(views)
    grid = (torch.arange(views) % side_n, torch.arange(views) // side_n)
    centre = torch.stack([(grid[0].float() + 0.5) * size / side_n, (grid[1].float() + 0.5) * size / side_n], 1)
    heading = torch.rand(views, generator=g) * 2 * math.pi
    altitude = 150 + 100 * torch.rand(views, generator=g)
    pitch = math.radians(45) + math.radians(15) * torch.rand(views, generator=g)
    reach = altitude / torch.tan(pitch)
    direction = torch.stack([torch.cos(heading), torch.sin(heading)], dim=1)
    eyes = torch.cat([centre - direction * reach[:, None] / 2, altitude[:, None]], dim=1)
    targets = torch.cat([centre + direction * reach[:, None] / 2, torch.zeros(views, 1)], dim=1)
    width, height = 1920, 1080
    focal = (width / 2) / math.tan(math.radians(30))
    return {"means": means, "scales": _spacing_scales(means), "viewmats": look_at(eyes, targets),
            "Ks": _intrinsics(views, width, height, focal), "width": width, "height": height}


def view_coverage(geometry: Geometry, sample: int = 20000) -> Tuple[float, float]:
    """(median, 90th percentile) share of the points each camera sees (a check of the generated cameras)."""
    means = geometry["means"]
    idx = torch.randperm(means.shape[0], generator=torch.Generator().manual_seed(0))[:sample]
    pts = torch.cat([means[idx], torch.ones(len(idx), 1)], dim=1)
    cam = torch.einsum("vij,nj->vni", geometry["viewmats"], pts)[..., :3]
    K = geometry["Ks"]
    z = cam[..., 2].clamp_min(1e-6)
    px = K[:, None, 0, 0] * cam[..., 0] / z + K[:, None, 0, 2]
    py = K[:, None, 1, 1] * cam[..., 1] / z + K[:, None, 1, 2]
    seen = (cam[..., 2] > 0.01) & (px >= 0) & (px < geometry["width"]) & (py >= 0) & (py < geometry["height"])
    share = seen.float().mean(dim=1)
    return float(share.median()), float(torch.quantile(share, 0.9))
