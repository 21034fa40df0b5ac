"""Ctrl+C on a distributed run: every rank stops at the same step boundary, rank 0 writes a final checkpoint, one
line says where, and the launcher exits 130. Real processes: the SIGINT goes to the launcher's process group, as
a terminal sends it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import psutil
import torch

from conftest import script
from test_faults import long_run, time_to_exit, wait_for_checkpoint, workers


def test_ctrl_c_stops_every_rank_with_a_final_checkpoint(tmp_path):
    with long_run(tmp_path) as launcher:
        wait_for_checkpoint(tmp_path, launcher, 5)
        ranks = list(workers(launcher).values())
        assert len(ranks) == 2
        stderr, took = time_to_exit(launcher, lambda: os.killpg(launcher.pid, signal.SIGINT))
    assert launcher.returncode == 130, stderr[-3000:]
    assert took < 30, f"the job took {took:.0f} s to stop"
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, "a rank outlived its launcher"
    stopped = [line for line in stderr.splitlines() if line.startswith("odin: stopped after step")]
    assert len(stopped) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    step, path = re.search(r"after step (\d+) .*checkpoint (\S+\.ckpt)", stopped[0]).groups()
    state = torch.load(path, map_location="cpu")
    assert state["step"] == int(step) and state["pipeline"]["_model.gauss_params.means"].shape[0] > 0
    config = Path(path).parents[1] / "config.yml"
    result = tmp_path / "eval.json"
    proc = subprocess.run([script("ns-eval"), "--load-config", str(config), "--output-path", str(result)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and result.exists(), proc.stderr[-3000:]
