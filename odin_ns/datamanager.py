"""The nerfstudio DataManager seam: full images, served to each rank in the order its plan gives.

`OdinDataManager` is nerfstudio's `FullImageDatamanager` with:
- the odin data parser default (built-in city scene, or the layout found under `--data`);
- bad input reported in one line (missing/empty folder, unreadable image) instead of a traceback;
- CPU-safe image caching (`cache_images cpu` pins memory, which needs CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Literal, Tuple, Type

import torch

from nerfstudio.cameras.cameras import Cameras
from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager, FullImageDatamanagerConfig
from nerfstudio.configs.dataparser_configs import AnnotatedDataParserUnion

from odin_ns.data.auto_dataparser import OdinAutoDataParserConfig, check_data_folder
from odin_ns.errors import OdinInputError

# Errors nerfstudio's parsers and image loaders raise on bad datasets (not on bugs of ours).
_DATA_ERRORS = (FileNotFoundError, NotADirectoryError, AssertionError, KeyError, ValueError, OSError)


@dataclass
class OdinDataManagerConfig(FullImageDatamanagerConfig):
    """nerfstudio's full-image datamanager options (`--pipeline.datamanager.*`), odin's parser by default."""

    _target: Type = field(default_factory=lambda: OdinDataManager)
    dataparser: AnnotatedDataParserUnion = field(default_factory=OdinAutoDataParserConfig)
    cache_images_type: Literal["uint8", "float32"] = "uint8"


class OdinDataManager(FullImageDatamanager):
    """Full images for Gaussian splatting, with one-line errors for bad datasets."""

    config: OdinDataManagerConfig

    def __init__(self, config: OdinDataManagerConfig, *args, **kwargs):
        if config.data is not None:
            check_data_folder(Path(config.data))
        if config.cache_images == "cpu" and not torch.cuda.is_available():
            config.cache_images = "gpu"  # nerfstudio's "gpu" means "the training device": here the CPU, unpinned
        try:
            super().__init__(config, *args, **kwargs)
        except OdinInputError:
            raise
        except _DATA_ERRORS as exc:
            where = config.data if config.data is not None else "the built-in scene"
            raise OdinInputError(f"cannot read the dataset at {where}: {type(exc).__name__}: {exc}") from exc

    def train_view(self, index: int) -> Tuple[Cameras, Dict[str, torch.Tensor]]:
        """Camera and batch of training view `index`, as nerfstudio's `next_train` builds them.

        The odin engine asks for views by index, in the order of its schedule (each rank its own views), instead
        of drawing them from nerfstudio's per-process random order.
        """
        data = dict(self.cached_train[index])
        data["image"] = data["image"].to(self.device)
        camera = self.train_cameras[index:index + 1].to(self.device)
        if camera.metadata is None:
            camera.metadata = {}
        camera.metadata["cam_idx"] = index
        return camera, data

    def _load_images(self, split, cache_images_device) -> List[Dict[str, torch.Tensor]]:
        try:
            return super()._load_images(split, cache_images_device)
        except _DATA_ERRORS as exc:
            dataset = self.train_dataset if split == "train" else self.eval_dataset
            bad = first_unreadable_image(dataset._dataparser_outputs.image_filenames)
            what = f"image {bad} cannot be loaded" if bad else f"loading the {split} images failed: {exc}"
            raise OdinInputError(f"{what} (fix or remove it from the dataset)") from exc


def first_unreadable_image(filenames) -> Path | None:
    """The first image file that is missing or that PIL cannot decode, if any."""
    from PIL import Image

    for name in filenames:
        try:
            with Image.open(name) as image:
                image.load()
        except Exception:  # any decode failure names the file
            return Path(name)
    return None

