"""The city's on-disk cache: reuse, atomic writes, concurrent generation by real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from odin_ns.data import city_cache
from odin_ns.data.city_scene import CityConfig

TINY = CityConfig(width=32, height=24, num_street_cameras=4, num_aerial_cameras=1, num_points=200)


def _entries(root: Path):
    return sorted(p.name for p in root.iterdir())


def test_ply_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    xyz = rng.normal(size=(50, 3)).astype(np.float32)
    rgb = rng.integers(0, 256, (50, 3)).astype(np.uint8)
    city_cache.write_ply(tmp_path / "p.ply", xyz, rgb)
    x2, c2 = city_cache.read_ply(tmp_path / "p.ply")
    assert np.array_equal(x2, xyz) and np.array_equal(c2, rgb)


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ODIN_NS_CACHE", str(tmp_path / "c"))
    assert city_cache.dataset_dir(TINY) == tmp_path / "c" / f"city-{TINY.key()}"
    monkeypatch.delenv("ODIN_NS_CACHE")
    assert city_cache.cache_root() == Path.home() / ".cache" / "odin_ns"


def test_cache_is_reused_and_repaired(tmp_path, monkeypatch):
    folder = city_cache.ensure_city(TINY, root=tmp_path)
    assert folder == tmp_path / f"city-{TINY.key()}"
    assert city_cache.check_dataset(folder, TINY) is None
    stamp = (folder / "transforms.json").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("regenerated a valid cache")

    monkeypatch.setattr(city_cache, "render_city", boom)
    assert city_cache.ensure_city(TINY, root=tmp_path) == folder
    assert (folder / "transforms.json").stat().st_mtime_ns == stamp
    monkeypatch.undo()

    # A damaged folder is moved aside and regenerated, identical to the first.
    before = (folder / "images" / "frame_00002.png").read_bytes()
    (folder / "images" / "frame_00002.png").unlink()
    assert city_cache.check_dataset(folder, TINY) is not None
    assert city_cache.ensure_city(TINY, root=tmp_path) == folder
    assert (folder / "images" / "frame_00002.png").read_bytes() == before
    assert _entries(tmp_path) == [folder.name, folder.name + ".lock"]

    ds = city_cache.load_city(folder)
    assert len(ds) == TINY.num_cameras and ds.config == TINY
    assert ds.visibility.shape == (TINY.num_cameras, len(ds.points_xyz))
    meta = json.loads((folder / "transforms.json").read_text())
    assert meta["odin_city"]["key"] == TINY.key()


_WORKER = r"""
import contextlib, os, sys, time
from pathlib import Path
from odin_ns.data import city_cache
from odin_ns.data.city_scene import CityConfig

start, nolock, meet = float(sys.argv[1]), sys.argv[2] == "nolock", Path(sys.argv[3])
cfg = CityConfig(width=32, height=24, num_street_cameras=4, num_aerial_cameras=1, num_points=200)
if nolock:
    # No working locks (e.g. some network file systems): both generate, and their renames race. Each process
    # waits inside the generation until the other has entered it too, so both always generate.
    city_cache._flock = lambda path: contextlib.nullcontext(False)
    real = city_cache.render_city
    def meeting(*a, **k):
        out = real(*a, **k)
        (meet / str(os.getpid())).touch()
        deadline = time.time() + 60
        while len(list(meet.iterdir())) < 2 and time.time() < deadline:
            time.sleep(0.05)
        return out
    city_cache.render_city = meeting
while time.time() < start:
    time.sleep(0.005)
log = lambda msg: print("GENERATED", flush=True)
print("PATH", city_cache.ensure_city(cfg, log=log), flush=True)
"""


@pytest.mark.parametrize("mode", ["lock", "nolock"])
def test_two_processes_generate_one_valid_cache(tmp_path, mode):
    env = dict(os.environ, ODIN_NS_CACHE=str(tmp_path))
    start = time.time() + 2.0
    meet = tmp_path / "meet"
    meet.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(start), mode, str(meet)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    paths = {line.split(" ", 1)[1] for out, _ in outs for line in out.splitlines() if line.startswith("PATH")}
    folder = tmp_path / f"city-{TINY.key()}"
    assert paths == {str(folder)}
    generated = sum(out.count("GENERATED") for out, _ in outs)
    # with the lock the second process waits and reuses the first one's work; without, both generate and one
    # rename loses the race (its identical copy is dropped)
    assert generated == (1 if mode == "lock" else 2)
    assert city_cache.check_dataset(folder, TINY) is None
    # Nothing half-written left behind.
    assert [e for e in _entries(tmp_path) if not e.endswith(".lock") and e != "meet"] == [folder.name]
    # And it is byte-identical to a fresh generation.
    other = city_cache.ensure_city(TINY, root=tmp_path / "fresh")
    for f in sorted(p for p in other.rglob("*") if p.is_file()):
        assert (folder / f.relative_to(other)).read_bytes() == f.read_bytes(), f
