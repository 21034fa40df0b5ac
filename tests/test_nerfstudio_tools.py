"""A 2-rank run with the live viewer on, then nerfstudio's own tools on its checkpoint, then resuming it.

The run trains two real gloo ranks with `--vis viewer` bound to 127.0.0.1: the test fetches the viewer's page
while training is going on. Its checkpoint (gathered by rank 0) must open unchanged in `ns-eval`,
`ns-export gaussian-splat` and `ns-viewer` (resuming is checked bit for bit in test_distributed_equivalence).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from conftest import FAST_TRAINING, TINY_CITY, last_checkpoint, run_dir, script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train 2 ranks for 60 steps with the viewer; return (output dir, whether the viewer answered mid-run)."""
    out = tmp_path_factory.mktemp("two_ranks")
    port = free_port()
    args = [a for a in FAST_TRAINING if a not in ("--vis", "tensorboard")]
    cmd = [sys.executable, "-m", "odin_ns.cli.train", "--ranks", "2", "odin", "--output-dir", str(out),
           "--vis", "viewer", "--viewer.websocket-host", "127.0.0.1", "--viewer.websocket-port", str(port),
           "--viewer.quit-on-train-completion", "True", "--pipeline.viewer-refresh-every", "10",
           "--max-num-iterations", "60", *args, *TINY_CITY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    served_while_training = False
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if not served_while_training and http_ok(port):
            served_while_training = proc.poll() is None
        time.sleep(0.5)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-5000:]
    return out, served_while_training


def test_live_viewer_serves_while_two_ranks_train(trained):
    _, served = trained
    assert served, "the viewer on rank 0 never answered while training ran"


def test_ns_eval_writes_metrics(trained, tmp_path):
    out, _ = trained
    result = tmp_path / "eval.json"
    subprocess.run([script("ns-eval"), "--load-config", str(run_dir(out) / "config.yml"), "--output-path", str(result)],
                   check=True, capture_output=True, timeout=300)
    metrics = json.loads(result.read_text())["results"]
    assert 5.0 < metrics["psnr"] < 60.0 and 0.0 < metrics["ssim"] <= 1.0


def test_ns_export_writes_every_gaussian(trained, tmp_path):
    out, _ = trained
    ckpt = torch.load(last_checkpoint(out), map_location="cpu")  # weights_only=True, as nerfstudio loads it
    n = ckpt["pipeline"]["_model.gauss_params.means"].shape[0]
    subprocess.run([script("ns-export"), "gaussian-splat", "--load-config", str(run_dir(out) / "config.yml"),
                    "--output-dir", str(tmp_path)], check=True, capture_output=True, timeout=300)
    header = (tmp_path / "splat.ply").read_bytes()[:2000].decode("latin-1")
    count = int(header.split("element vertex ")[1].split()[0])
    assert count == n > 0


def test_ns_viewer_serves_the_checkpoint(trained):
    out, _ = trained
    port = free_port()
    proc = subprocess.Popen([script("ns-viewer"), "--load-config", str(run_dir(out) / "config.yml"),
                             "--viewer.websocket-host", "127.0.0.1", "--viewer.websocket-port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, ok = time.time() + 120, False
        while time.time() < deadline and proc.poll() is None and not ok:
            ok = http_ok(port)
            time.sleep(0.5)
        assert ok, "ns-viewer did not serve the checkpoint"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
