"""Shared helpers: a tiny built-in city, in-process training, and `odin-train` runs as real processes."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FOX = SHARED_DATA / "fox"


@pytest.fixture(scope="session", autouse=True)
def _city_cache(tmp_path_factory):
    """One city cache for the whole session (subprocesses inherit it through the environment)."""
    os.environ.setdefault("ODIN_NS_CACHE", str(tmp_path_factory.mktemp("odin_cache")))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("ODIN_NS_RECORD_MESSAGES", "1")  # every run records its programs and messages (test_program)


@pytest.fixture
def one_thread():
    """Tiny scenes gain nothing from threads, and on a shared machine OpenMP fork/join can stall them."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# A small city and a schedule where densification happens early: refine at steps 20 and 30 (pause after the
# opacity reset at step 0 is num_train_views + refine_every = 14 + 5 steps).
# (a data parser sub-command and its options: they go last on the command line)
TINY_CITY = ["odin-city", "--width", "48", "--height", "36", "--num-street-cameras", "12",
             "--num-aerial-cameras", "4", "--num-points", "1500"]
# The runtime's tests count steps (`--pipeline.recipe steps`: nerfstudio's meaning, whatever the global batch); the
# recipe counted in views, and its exactness, are tested in test_recipe.py.
FAST_TRAINING = [
    "--vis", "tensorboard", "--pipeline.recipe", "steps",
    "--steps-per-eval-image", "100000", "--steps-per-eval-all-images", "100000",
    "--pipeline.model.num-downscales", "0",
    "--pipeline.model.warmup-length", "5",
    "--pipeline.model.refine-every", "5",
    "--pipeline.model.reset-alpha-every", "100",
    "--pipeline.model.densify-grad-thresh", "0.0008",
    "--pipeline.model.stop-screen-size-at", "0",  # screen-size splits: 5% of a 48-pixel image is 2 pixels
    "--pipeline.block-size", "256",
]


def script(name: str) -> str:
    """A console script of the environment running the tests (its bin/ need not be on PATH)."""
    return str(Path(sys.executable).with_name(name))


def odin_train(ranks: int, method: str, args: List[str], out: Path, timeout: float = 600,
               extra_env=None) -> subprocess.CompletedProcess:
    """Run `odin-train --ranks N METHOD args --output-dir out` as real processes; fail the test on error."""
    cmd = [sys.executable, "-m", "odin_ns.cli.train", "--ranks", str(ranks), method, "--output-dir", str(out), *args]
    env = dict(os.environ, **(extra_env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"odin-train failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


class Runs:
    """Trainings shared by the tests of a session: each distinct (ranks, method, arguments, environment) trains
    once, and every test that checks something of that run reads the same outputs (they check different things
    of it: the suite's time is mostly trainings)."""

    def __init__(self, root: Path):
        self.root = root
        self._done = {}

    def get(self, ranks: int, method: str, args: List[str], extra_env=None) -> Path:
        key = (ranks, method, tuple(args), tuple(sorted((extra_env or {}).items())))
        if key not in self._done:
            out = self.root / f"run{len(self._done)}-{method}-{ranks}r"
            if ranks == 1:
                train_in_process(method, list(args), out, extra_env or {})
            else:
                odin_train(ranks, method, list(args), out, extra_env=extra_env)
            self._done[key] = out
        return self._done[key]


def train_in_process(method: str, args: List[str], out: Path, extra_env) -> None:
    """One rank trained in this process: the same worker code a launched rank runs (`odin_ns.cli.worker.main`),
    without a launcher's start-up (seconds of imports per run), on one thread as a launched rank here. What a run
    leaves in nerfstudio's module state (its event writers, the SIGINT handler of its stop request) is undone."""
    import signal

    import torch

    from odin_ns.cli import worker  # first: nerfstudio's writer module alone is a circular import
    from nerfstudio.utils import writer

    saved_env = {k: os.environ.get(k) for k in extra_env}
    os.environ.update(extra_env)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert worker.main([method, "--output-dir", str(out), *args]) == 0
    finally:
        signal.signal(signal.SIGINT, handler)
        torch.set_num_threads(threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for w in writer.EVENT_WRITERS:
            if hasattr(w, "tb_writer"):
                w.tb_writer.close()
        writer.EVENT_WRITERS.clear()
        writer.EVENT_STORAGE.clear()
        writer.GLOBAL_BUFFER.clear()


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


def run_dir(out: Path) -> Path:
    """The single run folder (the one with config.yml) under an output dir."""
    configs = glob.glob(str(out / "**" / "config.yml"), recursive=True)
    assert len(configs) == 1, configs
    return Path(configs[0]).parent


def last_checkpoint(out: Path) -> Path:
    ckpts = sorted(glob.glob(str(run_dir(out) / "nerfstudio_models" / "*.ckpt")))
    assert ckpts, f"no checkpoint under {out}"
    return Path(ckpts[-1])
