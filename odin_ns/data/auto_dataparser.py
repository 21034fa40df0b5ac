"""The default data parser of the odin methods: the built-in city when `--data` is not given, else the format found.

nerfstudio picks a parser from a sub-command (`instant-ngp-data`, `colmap`, ...), and those still work. Without
one, `ns-train odin --data DIR` looks at DIR and hands it to nerfstudio's own parser for what it finds there, and
says what it expected when it finds nothing it knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Type

from nerfstudio.data.dataparsers.base_dataparser import DataParser, DataParserConfig

from odin_ns.data.city_dataparser import OdinCityDataParserConfig
from odin_ns.errors import OdinInputError

KNOWN_LAYOUTS = ("transforms.json (nerfstudio or instant-ngp), transforms_train.json (blender), "
                 "sparse/0 or colmap/sparse/0 (colmap)")


def check_data_folder(data: Path) -> None:
    """Fail with one line when the data folder is missing or empty."""
    if not data.exists():
        raise OdinInputError(f"data folder {data} does not exist (pass --data with a dataset folder, "
                             "or leave --data out for the built-in city scene)")
    if data.is_dir() and not any(data.iterdir()):
        raise OdinInputError(f"data folder {data} is empty (it needs {KNOWN_LAYOUTS})")


def detect_parser(data: Path) -> DataParserConfig:
    """The nerfstudio parser config for the dataset layout found at `data`."""
    from nerfstudio.data.dataparsers.blender_dataparser import BlenderDataParserConfig
    from nerfstudio.data.dataparsers.colmap_dataparser import ColmapDataParserConfig
    from nerfstudio.data.dataparsers.instant_ngp_dataparser import InstantNGPDataParserConfig
    from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig

    check_data_folder(data)
    folder = data if data.is_dir() else data.parent
    transforms = data if data.is_file() else folder / "transforms.json"
    if transforms.exists():
        try:
            meta = json.loads(transforms.read_text())
        except (OSError, ValueError) as exc:
            raise OdinInputError(f"cannot read {transforms}: {exc} (is it a nerfstudio/instant-ngp transforms.json?)")
        if not isinstance(meta, dict) or not meta.get("frames"):
            raise OdinInputError(f"{transforms} lists no frames (a transforms.json needs a 'frames' list)")
        if "camera_model" in meta:
            return NerfstudioDataParserConfig(data=data, load_3D_points=True)
        return InstantNGPDataParserConfig(data=data)
    if (folder / "transforms_train.json").exists():
        return BlenderDataParserConfig(data=folder)
    for colmap in (Path("sparse/0"), Path("colmap/sparse/0")):
        if (folder / colmap).is_dir():
            return ColmapDataParserConfig(data=folder, colmap_path=colmap, load_3D_points=True)
    raise OdinInputError(f"no dataset layout recognised in {data}: expected {KNOWN_LAYOUTS}; "
                         "or name the format, e.g. `ns-train odin --data DIR instant-ngp-data`")


@dataclass
class OdinAutoDataParserConfig(DataParserConfig):
    """Built-in city scene without --data; with --data, nerfstudio's parser for the layout found there."""

    _target: Type = field(default_factory=lambda: DataParser)
    data: Optional[Path] = None
    """Dataset folder; leave out for the built-in city scene."""
    city: OdinCityDataParserConfig = field(default_factory=OdinCityDataParserConfig)
    """The built-in scene's settings (used when --data is not given)."""

    def resolve(self) -> DataParserConfig:
        """The concrete parser config this stands for."""
        if self.data is None:
            return self.city
        return detect_parser(Path(self.data))

    def setup(self, **kwargs) -> DataParser:
        return self.resolve().setup(**kwargs)
