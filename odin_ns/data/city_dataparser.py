"""nerfstudio data parser for the built-in city scene (`odin-city`).

Without `data` it generates (or reuses from the cache, see `city_cache`) the procedural city described by its
fields. With `data`: a folder holding an odin-city `transforms.json` is loaded as is; any other folder is used as
the cache root instead of `$ODIN_NS_CACHE` / `~/.cache/odin_ns`.

Output frame: the stored scene (metres, z up, ground at z=0, street grid centred on the origin) scaled by
`unit_scale` so that the street network, outer sidewalks included, spans [-1, 1] in x and y (1 unit = 60 m for
3x3 blocks); buildings reach z <= ~0.9 for the default size, the ground margin reaches |x|, |y| <= 1.4 and the
aerial cameras sit at z ~ 0.9-1.2 (larger cities shrink everything by the same rule). No
rotation or translation (`dataparser_transform` is the identity, `dataparser_scale` the unit scale). Cameras use
nerfstudio's OpenGL convention (look down -Z, +Y up). The nearest surface a street camera sees is >= 2 m away,
about 0.03 in these units, above the rasterizer's near plane of 0.01.

Images are RGBA with a transparent sky. With `sky_color` unset the alpha reaches the model (splatfacto
composites the ground truth onto its own background); set it to composite the sky to a fixed colour instead.

Split: views are held out per kind (street, aerial): the k-th view of a kind is an eval view when
k % eval_interval == eval_interval // 2, so both kinds are evaluated and eval views see parts of the city just as
train views do. eval_interval <= 0 uses every view for both splits.

metadata: points3D_xyz (float32 [P, 3]) and points3D_rgb (uint8 [P, 3]) seed splatfacto; points3D_visibility
(bool [views of this split, P]) says exactly which seed points each view sees (a ground-truth read set);
odin_city_view_indices lists the split's views in the full camera list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple, Type

import numpy as np
import torch

from nerfstudio.cameras.cameras import Cameras, CameraType
from nerfstudio.data.dataparsers.base_dataparser import DataParser, DataParserConfig, DataparserOutputs
from nerfstudio.data.scene_box import SceneBox

from odin_ns.data.city_cache import TRANSFORMS, CityDataset, ensure_city, load_city
from odin_ns.data.city_scene import CityConfig


@dataclass
class OdinCityDataParserConfig(DataParserConfig):
    """The built-in procedural city block (generated on first use, cached on disk)."""

    _target: Type = field(default_factory=lambda: OdinCityDataParser)
    data: Optional[Path] = None
    """Leave out to generate the built-in scene. A folder with an odin-city transforms.json is loaded as is; any
    other folder becomes the cache root."""
    seed: int = 0
    """Seed of the layout, textures, cameras and seed points."""
    blocks_x: int = 3
    """Buildings along x."""
    blocks_y: int = 3
    """Buildings along y."""
    width: int = 128
    """Image width in pixels."""
    height: int = 96
    """Image height in pixels."""
    num_street_cameras: int = 42
    """Street-level views (along streets, at facades, diagonal)."""
    num_aerial_cameras: int = 6
    """Low aerial oblique views."""
    num_survey_cameras: int = 0
    """Aerial survey views: a grid of near-nadir views above the roofs with photogrammetry-like overlap (each
    sees a small part of the city: the case where read sets are selective). `odin-bench --scene city-aerial`."""
    supersample: int = 2
    """Anti-aliasing: supersample x supersample rays per pixel."""
    num_points: int = 4000
    """Seed points (surface points seen by at least two views)."""
    point_jitter: float = 0.05
    """Noise (metres, before scaling) on the seed point positions."""
    shadows: bool = True
    """Bake sun shadows into the images."""
    eval_interval: int = 8
    """Hold out every eval_interval-th view of each kind; <= 0: all views in both splits."""
    sky_color: Optional[Tuple[float, float, float]] = None
    """Composite the transparent sky onto this colour (0-1); None passes RGBA to the model."""
    cache_dir: Optional[Path] = None
    """Cache root; default $ODIN_NS_CACHE, else ~/.cache/odin_ns."""

    def city_config(self) -> CityConfig:
        return CityConfig(
            seed=self.seed, blocks_x=self.blocks_x, blocks_y=self.blocks_y, width=self.width, height=self.height,
            num_street_cameras=self.num_street_cameras, num_aerial_cameras=self.num_aerial_cameras,
            num_survey_cameras=self.num_survey_cameras,
            supersample=self.supersample, num_points=self.num_points, point_jitter=self.point_jitter,
            shadows=self.shadows,
        )


def split_indices(kinds: List[str], eval_interval: int) -> Tuple[np.ndarray, np.ndarray]:
    """(train, eval) view indices: per kind, the k-th view is eval when k % eval_interval == eval_interval // 2."""
    n = len(kinds)
    if eval_interval <= 0:
        every = np.arange(n)
        return every, every
    is_eval = np.zeros(n, dtype=bool)
    seen = {}
    for i, kind in enumerate(kinds):
        k = seen.get(kind, 0)
        seen[kind] = k + 1
        is_eval[i] = k % eval_interval == eval_interval // 2
    return np.nonzero(~is_eval)[0], np.nonzero(is_eval)[0]


@dataclass
class OdinCityDataParser(DataParser):
    config: OdinCityDataParserConfig
    downscale_factor: Optional[int] = None  # set by nerfstudio's datamanagers in inference mode; unused

    def __init__(self, config: OdinCityDataParserConfig):
        super().__init__(config=config)
        self._dataset: Optional[CityDataset] = None

    def dataset(self) -> CityDataset:
        """The stored dataset, generated on first use."""
        if self._dataset is None:
            from nerfstudio.utils.rich_utils import CONSOLE

            data = self.config.data
            if data is not None and (Path(data) / TRANSFORMS).is_file():
                meta = json.loads((Path(data) / TRANSFORMS).read_text(encoding="utf-8"))
                if "odin_city" not in meta:
                    raise ValueError(f"{data} is not an odin-city dataset (no odin_city section in {TRANSFORMS}); "
                                     "use a nerfstudio parser for other data")
                folder = Path(data)
            else:
                root = Path(data) if data is not None else self.config.cache_dir
                folder = ensure_city(self.config.city_config(), root=root, log=CONSOLE.log)
                # Tell nerfstudio where the data is (experiment names, viewer, get_datapath()).
                self.config.data = folder
            self._dataset = load_city(folder)
        return self._dataset

    def _generate_dataparser_outputs(self, split: str = "train", **kwargs) -> DataparserOutputs:
        ds = self.dataset()
        train, evals = split_indices(ds.kinds, self.config.eval_interval)
        if split == "train":
            idx = train
        elif split in ("val", "test", "eval"):
            idx = evals
        elif split == "all":
            idx = np.arange(len(ds))
        else:
            raise ValueError(f"unknown split {split!r}")
        s = ds.unit_scale
        c2w = ds.c2w[idx, :3, :4].copy()
        c2w[:, :3, 3] *= s
        cameras = Cameras(
            camera_to_worlds=torch.from_numpy(c2w).float(),
            fx=torch.from_numpy(ds.fx[idx]).float()[:, None],
            fy=torch.from_numpy(ds.fy[idx]).float()[:, None],
            cx=torch.from_numpy(ds.cx[idx]).float()[:, None],
            cy=torch.from_numpy(ds.cy[idx]).float()[:, None],
            width=torch.full((len(idx), 1), ds.width, dtype=torch.int64),
            height=torch.full((len(idx), 1), ds.height, dtype=torch.int64),
            camera_type=CameraType.PERSPECTIVE,
        )
        aabb = torch.tensor(ds.meta["odin_city"]["scene_aabb"], dtype=torch.float32) * s
        xyz = torch.from_numpy(ds.points_xyz * np.float32(s)).float()
        metadata = {
            "points3D_xyz": xyz,
            "points3D_rgb": torch.from_numpy(ds.points_rgb.copy()),
            "points3D_visibility": torch.from_numpy(ds.visibility[idx].copy()),
            "odin_city_view_indices": torch.from_numpy(idx.astype(np.int64)),
        }
        alpha = None
        if self.config.sky_color is not None:
            alpha = torch.tensor(self.config.sky_color, dtype=torch.float32)
        return DataparserOutputs(
            image_filenames=[ds.image_paths[i] for i in idx],
            cameras=cameras,
            alpha_color=alpha,
            scene_box=SceneBox(aabb=aabb),
            metadata=metadata,
            dataparser_transform=torch.eye(4)[:3, :],
            dataparser_scale=s,
        )
