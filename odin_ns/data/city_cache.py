"""On-disk cache of the built-in city dataset: generate once per config, share between processes.

Layout of one dataset folder (`<root>/city-<config key>/`), a nerfstudio / instant-ngp style capture in metres:
    images/frame_00000.png ...   RGBA, sky transparent (alpha 0)
    transforms.json              nerfstudio format: per-frame OpenGL camera-to-world + intrinsics, plus an
                                 "odin_city" section (config, key, unit scale, per-view statistics)
    points3D.ply                 seed points (binary PLY: float x y z, uchar red green blue), metres
    visibility.npy               bool [num_views, num_points]: which seed points each view sees (exact)

The root is `$ODIN_NS_CACHE` if set, else `~/.cache/odin_ns`. A folder appears only complete: it is written
under a temporary name in the same root and renamed into place (rename is atomic on POSIX). Writers also take an
advisory lock (flock) so that ranks starting together generate once; without working locks (some network file
systems) they each generate, the first rename wins and the others discard their copy. A folder that fails its
check (files missing, key mismatch) is moved aside and regenerated.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np

from odin_ns.data.city_scene import (GENERATOR_VERSION, CityConfig, CityRender, render_city, unit_scale)

CACHE_ENV = "ODIN_NS_CACHE"
TRANSFORMS = "transforms.json"
POINTS = "points3D.ply"
VISIBILITY = "visibility.npy"
STALE_TMP_AGE_S = 3600.0


def cache_root(root: Optional[os.PathLike] = None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "odin_ns"


def dataset_dir(cfg: CityConfig, root: Optional[os.PathLike] = None) -> Path:
    return cache_root(root) / f"city-{cfg.key()}"


# ----------------------------------------------------------------------------------------------------------------
# PLY


_PLY_DTYPE = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")])


def write_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    data = np.empty(len(xyz), dtype=_PLY_DTYPE)
    for k, name in enumerate("xyz"):
        data[name] = xyz[:, k]
    for k, name in enumerate(("red", "green", "blue")):
        data[name] = rgb[:, k]
    header = ("ply\nformat binary_little_endian 1.0\n"
              f"element vertex {len(xyz)}\n"
              "property float x\nproperty float y\nproperty float z\n"
              "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n")
    with open(path, "wb") as f:
        f.write(header.encode("ascii"))
        f.write(data.tobytes())


def read_ply(path: Path):
    """(xyz float32 [P, 3], rgb uint8 [P, 3]) from a PLY written by `write_ply`."""
    raw = Path(path).read_bytes()
    end = raw.index(b"end_header\n") + len(b"end_header\n")
    header = raw[:end].decode("ascii").splitlines()
    if "format binary_little_endian 1.0" not in header:
        raise ValueError(f"{path}: unsupported PLY format")
    n = next(int(line.split()[2]) for line in header if line.startswith("element vertex"))
    data = np.frombuffer(raw, dtype=_PLY_DTYPE, count=n, offset=end)
    xyz = np.stack([data["x"], data["y"], data["z"]], axis=-1).astype(np.float32)
    rgb = np.stack([data["red"], data["green"], data["blue"]], axis=-1).astype(np.uint8)
    return xyz, rgb


# ----------------------------------------------------------------------------------------------------------------
# Writing


def write_dataset(render: CityRender, folder: Path) -> None:
    """Write a rendered city into an (empty or new) folder. Deterministic bytes for a deterministic render."""
    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    cams = render.cameras
    cfg = render.config
    vis = render.points_visibility
    frames = []
    for i, img in enumerate(render.images):
        name = f"images/frame_{i:05d}.png"
        Image.fromarray(np.ascontiguousarray(img)).save(folder / name, format="PNG", compress_level=6)
        frames.append({
            "file_path": name,
            "transform_matrix": [[float(x) for x in row] for row in cams.c2w[i]],
            "fl_x": float(cams.fx[i]),
            "fl_y": float(cams.fy[i]),
            "cx": float(cams.cx[i]),
            "cy": float(cams.cy[i]),
            "odin_kind": cams.kind[i],
        })
    write_ply(folder / POINTS, render.points_xyz, render.points_rgb)
    np.save(folder / VISIBILITY, vis)
    city = render.city
    aabb = [[float(city.ground_extent[0]), float(city.ground_extent[2]), 0.0],
            [float(city.ground_extent[1]), float(city.ground_extent[3]), float(city.max_height)]]
    meta = {
        "camera_model": "OPENCV",
        "w": int(cams.width),
        "h": int(cams.height),
        "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0,
        "ply_file_path": POINTS,
        "frames": frames,
        "odin_city": {
            "generator_version": GENERATOR_VERSION,
            "key": cfg.key(),
            "config": cfg.to_dict(),
            "units": "metres, z up, ground z=0",
            "unit_scale": unit_scale(city),
            "scene_aabb": aabb,
            "num_boxes": int(len(city.lo)),
            "num_points": int(len(render.points_xyz)),
            "visibility_file": VISIBILITY,
            "visible_fraction_of_points": [round(float(x), 6) for x in vis.mean(axis=1)],
        },
    }
    with open(folder / TRANSFORMS, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")


def check_dataset(folder: Path, cfg: Optional[CityConfig] = None) -> Optional[str]:
    """None when folder holds a complete dataset (of cfg, if given); else what is wrong."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / TRANSFORMS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"cannot read {TRANSFORMS}: {exc}"
    info = meta.get("odin_city")
    if not isinstance(info, dict):
        return f"{TRANSFORMS} has no odin_city section"
    if cfg is not None and info.get("key") != cfg.key():
        return f"key {info.get('key')} != {cfg.key()}"
    for fr in meta.get("frames", []):
        if not (folder / fr["file_path"]).is_file():
            return f"missing {fr['file_path']}"
    for name in (POINTS, VISIBILITY):
        if not (folder / name).is_file():
            return f"missing {name}"
    return None


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[bool]:
    """Exclusive advisory lock on `path` (created if needed); yields False when locking is not available."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield False
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False
        yield locked
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _remove_stale_tmp(root: Path, name: str) -> None:
    now = time.time()
    for p in root.glob(f"{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > STALE_TMP_AGE_S:
                shutil.rmtree(p, ignore_errors=True)


def ensure_city(cfg: CityConfig, root: Optional[os.PathLike] = None, num_threads: Optional[int] = None,
                log=None) -> Path:
    """Folder of the complete dataset for cfg, generating it (once across processes) when missing."""
    final = dataset_dir(cfg, root)
    if check_dataset(final, cfg) is None:
        return final
    base = final.parent
    base.mkdir(parents=True, exist_ok=True)
    with _flock(base / f"{final.name}.lock"):
        problem = check_dataset(final, cfg)
        if problem is None:  # another process finished it while we waited
            return final
        if final.exists():  # incomplete or foreign: move aside atomically, then delete
            aside = Path(tempfile.mkdtemp(prefix=f"{final.name}.stale-", dir=base))
            try:
                os.rename(final, aside / "old")
            except OSError:
                pass
            shutil.rmtree(aside, ignore_errors=True)
            if check_dataset(final, cfg) is None:
                return final
        _remove_stale_tmp(base, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=base))
        try:
            t0 = time.perf_counter()
            render = render_city(cfg, num_threads=num_threads)
            write_dataset(render, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
            if log is not None:
                log(f"odin-city: generated {cfg.num_cameras} views of {cfg.width}x{cfg.height} and "
                    f"{len(render.points_xyz)} seed points in {time.perf_counter() - t0:.1f}s -> {final}")
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or check_dataset(final, cfg) is not None:
                    raise
                # Lost a race with a process that could not lock: its copy is identical, keep it.
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    problem = check_dataset(final, cfg)
    if problem is not None:
        raise RuntimeError(f"odin-city cache {final} is not valid after generation: {problem}")
    return final


# ----------------------------------------------------------------------------------------------------------------
# Reading


@dataclass
class CityDataset:
    """A generated dataset as stored (metres)."""

    folder: Path
    meta: Dict
    image_paths: List[Path]
    c2w: np.ndarray  # (N, 4, 4) OpenGL
    fx: np.ndarray
    fy: np.ndarray
    cx: np.ndarray
    cy: np.ndarray
    width: int
    height: int
    kinds: List[str]
    points_xyz: np.ndarray  # float32 [P, 3]
    points_rgb: np.ndarray  # uint8 [P, 3]
    visibility: np.ndarray  # bool [N, P]

    @property
    def unit_scale(self) -> float:
        return float(self.meta["odin_city"]["unit_scale"])

    @property
    def config(self) -> CityConfig:
        return CityConfig(**self.meta["odin_city"]["config"])

    def __len__(self) -> int:
        return len(self.image_paths)


def load_city(folder: os.PathLike) -> CityDataset:
    folder = Path(folder)
    problem = check_dataset(folder)
    if problem is not None:
        raise FileNotFoundError(f"{folder} is not an odin-city dataset: {problem}")
    meta = json.loads((folder / TRANSFORMS).read_text(encoding="utf-8"))
    frames = meta["frames"]
    xyz, rgb = read_ply(folder / POINTS)
    vis = np.load(folder / VISIBILITY)
    return CityDataset(
        folder=folder,
        meta=meta,
        image_paths=[folder / fr["file_path"] for fr in frames],
        c2w=np.array([fr["transform_matrix"] for fr in frames], dtype=np.float64).reshape(-1, 4, 4),
        fx=np.array([fr["fl_x"] for fr in frames], dtype=np.float64),
        fy=np.array([fr["fl_y"] for fr in frames], dtype=np.float64),
        cx=np.array([fr["cx"] for fr in frames], dtype=np.float64),
        cy=np.array([fr["cy"] for fr in frames], dtype=np.float64),
        width=int(meta["w"]),
        height=int(meta["h"]),
        kinds=[fr.get("odin_kind", "street") for fr in frames],
        points_xyz=xyz,
        points_rgb=rgb,
        visibility=vis,
    )
