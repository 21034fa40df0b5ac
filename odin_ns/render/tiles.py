"""Tile geometry and Gaussian/tile intersection lists for the CPU rasterizer (no autograd).

Why this file exists: gsplat's `isect_tiles` is a CUDA kernel and its PyTorch twin in `_torch_impl` loops in
Python per Gaussian, so neither is usable on CPU at training sizes. What is written here by hand is the
vectorized listing.

Two tile sizes are in play:
- gsplat's `tile_size` (16 by default) decides WHICH pixels a Gaussian may touch: gsplat only composites a
  Gaussian in the tiles of `[floor((m - r) / ts), ceil((m + r) / ts))` (r = its integer radius), so a
  high-opacity Gaussian can be cut at a tile border. We reproduce that rectangle exactly.
- the sub-tile size `s` (a divisor of `tile_size`) is the unit of work on CPU. Small sub-tiles waste fewer
  Gaussian-pixel candidates; on this machine 4x4 was the fastest.
Within gsplat's rectangle, we further shrink each Gaussian's box to where its alpha can reach 1/255 (the
ellipse 0.5 d^T conic d <= log(255 opacity)), with a conservative margin, so no pixel that gsplat's rule
would composite is ever dropped; the exact per-pixel test is still done when compositing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class TileGrid:
    """Sub-tile layout of C images of H x W pixels: tile t, local pixel p = (p // s) * s + p % s."""

    n_cameras: int
    width: int
    height: int
    s: int

    def __post_init__(self) -> None:
        self.tiles_x = math.ceil(self.width / self.s)
        self.tiles_y = math.ceil(self.height / self.s)
        self.tiles_per_cam = self.tiles_x * self.tiles_y
        self.n_tiles = self.n_cameras * self.tiles_per_cam
        self.P = self.s * self.s

    def pixel_centers(self, dtype: torch.dtype, device: torch.device):
        """Pixel centers (x + 0.5, y + 0.5) per tile [n_tiles, P] and a mask of pixels inside the image."""
        s = self.s
        t = torch.arange(self.tiles_per_cam, device=device)
        p = torch.arange(self.P, device=device)
        xi = (t % self.tiles_x)[:, None] * s + (p % s)[None, :]
        yi = (t // self.tiles_x)[:, None] * s + (p // s)[None, :]
        inside = (xi < self.width) & (yi < self.height)
        px = (xi.to(dtype) + 0.5).repeat(self.n_cameras, 1)
        py = (yi.to(dtype) + 0.5).repeat(self.n_cameras, 1)
        return px, py, inside.repeat(self.n_cameras, 1)

    def image_to_tiles(self, img: Tensor) -> Tensor:
        """[C, H, W, D] -> [n_tiles, P, D] (zero padded to whole tiles)."""
        C, H, W, D = img.shape
        s = self.s
        ph, pw = self.tiles_y * s - H, self.tiles_x * s - W
        if ph or pw:
            img = torch.nn.functional.pad(img, (0, 0, 0, pw, 0, ph))
        img = img.reshape(C, self.tiles_y, s, self.tiles_x, s, D).permute(0, 1, 3, 2, 4, 5)
        return img.reshape(self.n_tiles, self.P, D)

    def tiles_to_image(self, tiles: Tensor) -> Tensor:
        """[n_tiles, P, D] -> [C, H, W, D] (padding cropped)."""
        D = tiles.shape[-1]
        s = self.s
        img = tiles.reshape(self.n_cameras, self.tiles_y, self.tiles_x, s, s, D).permute(0, 1, 3, 2, 4, 5)
        img = img.reshape(self.n_cameras, self.tiles_y * s, self.tiles_x * s, D)
        return img[:, : self.height, : self.width]


@dataclass
class Isects:
    """Per sub-tile lists of entries (flattened camera x Gaussian indices), front to back.

    entry[starts[t] : starts[t] + lengths[t]] are the entries tile t may composite, in gsplat's order:
    ascending depth (compared as the float's bit pattern, like gsplat's sort key), ties by entry index.
    """

    grid: TileGrid
    entry: Tensor  # [I] int64
    starts: Tensor  # [n_tiles] int64
    lengths: Tensor  # [n_tiles] int64
    risky: Optional[Tensor] = None  # [E] bool, entries whose power may round below 0 (None: no such entry)


def _depth_sort_key(depths: Tensor) -> Tensor:
    # gsplat sorts intersections by the depth's IEEE bit pattern read as a signed integer.
    if depths.dtype == torch.float32:
        return depths.contiguous().view(torch.int32)
    if depths.dtype == torch.float64:
        return depths.contiguous().view(torch.int64)
    return depths.float().contiguous().view(torch.int32)


def risky_conics(conics: Tensor) -> Tensor:
    """Conics whose power 0.5 (a dx^2 + c dy^2) + b dx dy may round below 0 (gsplat then skips the pixel).

    With a, c > 0 and b^2 <= (1 - 10 u)^2 a c (u = unit roundoff) the rounded power cannot be negative, since
    0.5 (a dx^2 + c dy^2) >= sqrt(a c) |dx dy|; det >= 1e-4 a c is far inside that. Only near-singular conics
    (needle-like splats) need the explicit check.
    """
    a, b, c = conics.unbind(1)
    return ~((a > 0) & (c > 0) & (a * c - b * b >= 1e-4 * a * c))


def _alpha_extent(conics: Tensor, opacities: Tensor):
    """Half extents (x, y) in pixels of the region where opacity * exp(-power) can reach 1/255.

    power = 0.5 d^T Q d with Q = [[a, b], [b, c]]; the ellipse 0.5 d^T Q d <= t spans
    |dx| <= sqrt(2 t (Q^-1)_xx). Computed in float64 with margins for float32 rounding of power
    (cancellation between its terms grows with |Q| * |d|^2) so that the box is conservative.
    """
    q = conics.double()
    a, b, c = q[:, 0], q[:, 1], q[:, 2]
    det = a * c - b * b
    t = torch.log(255.0 * opacities.double()).clamp_min(0.0)
    sxx = c / det
    syy = a / det
    ok = (det > 0) & (sxx > 0) & (syy > 0)
    sxx = torch.where(ok, sxx, torch.full_like(sxx, math.inf))
    syy = torch.where(ok, syy, torch.full_like(syy, math.inf))
    ex0 = torch.sqrt(2.0 * t * sxx)
    ey0 = torch.sqrt(2.0 * t * syy)
    # absolute rounding error bound of fl32(power) near the boundary, plus exp/compare rounding
    err = 1e-6 * (a.abs() + c.abs() + 2.0 * b.abs()) * (ex0 * ex0 + ey0 * ey0) + 1e-6 * (1.0 + t)
    t2 = t * (1.0 + 1e-5) + err
    ex = torch.sqrt(2.0 * t2 * sxx) + 1e-3
    ey = torch.sqrt(2.0 * t2 * syy) + 1e-3
    return ex, ey


@torch.no_grad()
def build_isects(
    grid: TileGrid,
    means2d: Tensor,  # [E, 2]
    conics: Tensor,  # [E, 3]
    opacities: Tensor,  # [E] (after antialiasing compensation)
    depths: Tensor,  # [E]
    radii: Tensor,  # [E] int
    entry_cam: Tensor,  # [E] int64 camera of each entry
    tile_size: int,
) -> Isects:
    device = means2d.device
    s = grid.s
    W, H = grid.width, grid.height
    # an entry whose opacity is under 1/255 can never pass gsplat's alpha >= 1/255 test (exp(-power) <= 1)
    ids = ((radii > 0) & (opacities >= 1.0 / 255.0)).nonzero().squeeze(1)
    order = torch.sort(_depth_sort_key(depths[ids]), stable=True).indices
    ids = ids[order]

    m = means2d[ids]
    # gsplat's tile rectangle, same float arithmetic as its isect_tiles kernel
    ts = float(tile_size)
    tw, th = math.ceil(W / tile_size), math.ceil(H / tile_size)
    tr = radii[ids].to(m.dtype) / ts
    tx, ty = m[:, 0] / ts, m[:, 1] / ts
    gx0 = torch.floor(tx - tr).clamp(0, tw).long() * tile_size
    gx1 = torch.ceil(tx + tr).clamp(0, tw).long() * tile_size - 1
    gy0 = torch.floor(ty - tr).clamp(0, th).long() * tile_size
    gy1 = torch.ceil(ty + tr).clamp(0, th).long() * tile_size - 1

    # tight box where alpha can reach 1/255 (pixel x is covered when |x + 0.5 - mx| <= ex)
    ex, ey = _alpha_extent(conics[ids], opacities[ids])
    md = m.double()
    big = float(4 * max(W, H) + 16)
    x0 = torch.ceil((md[:, 0] - ex - 0.5).clamp(-big, big)).long()
    x1 = torch.floor((md[:, 0] + ex - 0.5).clamp(-big, big)).long()
    y0 = torch.ceil((md[:, 1] - ey - 0.5).clamp(-big, big)).long()
    y1 = torch.floor((md[:, 1] + ey - 0.5).clamp(-big, big)).long()
    x0 = torch.maximum(x0, gx0).clamp_min(0)
    x1 = torch.minimum(x1, gx1).clamp_max(W - 1)
    y0 = torch.maximum(y0, gy0).clamp_min(0)
    y1 = torch.minimum(y1, gy1).clamp_max(H - 1)
    sx0, sx1 = torch.div(x0, s, rounding_mode="floor"), torch.div(x1, s, rounding_mode="floor")
    sy0, sy1 = torch.div(y0, s, rounding_mode="floor"), torch.div(y1, s, rounding_mode="floor")
    nx = (sx1 - sx0 + 1).clamp_min(0)
    ny = (sy1 - sy0 + 1).clamp_min(0)
    cnt = torch.where((x1 >= x0) & (y1 >= y0), nx * ny, torch.zeros_like(nx))

    # Enumerate (entry, sub-tile) pairs in two levels, so the big level only repeats values (no gathers):
    # rows of sub-tiles per entry, then the consecutive tile ids along each row.
    keep = cnt > 0
    ids, nx, ny = ids[keep], nx[keep], ny[keep]
    base = entry_cam[ids] * grid.tiles_per_cam + sy0[keep] * grid.tiles_x + sx0[keep]  # top-left sub-tile
    n_rows = int(ny.sum())
    row_first = torch.cumsum(ny, 0) - ny
    row_j = torch.arange(n_rows, device=device) - torch.repeat_interleave(row_first, ny, output_size=n_rows)
    row_tile0 = torch.repeat_interleave(base, ny, output_size=n_rows) + row_j * grid.tiles_x
    row_nx = torch.repeat_interleave(nx, ny, output_size=n_rows)
    row_ent = torch.repeat_interleave(ids, ny, output_size=n_rows)
    n = int(row_nx.sum())
    isect_first = torch.cumsum(row_nx, 0) - row_nx
    idt = torch.int32 if grid.n_tiles + n < 2**31 else torch.int64
    tile = torch.repeat_interleave((row_tile0 - isect_first).to(idt), row_nx, output_size=n)
    tile += torch.arange(n, device=device, dtype=idt)
    ent = torch.repeat_interleave(row_ent, row_nx, output_size=n)
    # stable: within a tile, entries stay in depth order
    perm = torch.sort(tile, stable=True).indices
    entry = ent.index_select(0, perm)
    lengths = torch.bincount(tile, minlength=grid.n_tiles)
    starts = torch.cumsum(lengths, 0) - lengths
    risky = None
    r = risky_conics(conics.index_select(0, ids))
    if bool(r.any()):
        risky = torch.zeros(len(means2d), dtype=torch.bool, device=device)
        risky[ids[r]] = True
    return Isects(grid=grid, entry=entry, starts=starts, lengths=lengths, risky=risky)


@torch.no_grad()
def gsplat_tiles_per_gauss(means2d: Tensor, radii: Tensor, tile_size: int, width: int, height: int) -> Tensor:
    """gsplat's `tiles_per_gauss` meta entry: how many of its tile_size tiles each projected Gaussian touches."""
    tw, th = math.ceil(width / tile_size), math.ceil(height / tile_size)
    tr = radii.to(means2d.dtype) / float(tile_size)
    t = means2d / float(tile_size)
    nx = torch.ceil(t[..., 0] + tr).clamp(0, tw) - torch.floor(t[..., 0] - tr).clamp(0, tw)
    ny = torch.ceil(t[..., 1] + tr).clamp(0, th) - torch.floor(t[..., 1] - tr).clamp(0, th)
    return torch.where(radii > 0, nx * ny, torch.zeros_like(nx)).to(torch.int32)
