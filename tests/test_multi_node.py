"""Several machines as users start them: the same `odin-train` command on every node, started when each is ready.

Two launchers on this machine play two nodes of one rank each, meeting at a c10d rendezvous on 127.0.0.1 (the
README's multi-node line, with this machine's address and a port). Started seconds apart they make one run (one
output folder, written by the node that holds rank 0, one checkpoint that `ns-eval` opens, one odin_stats.json);
killing one node's launcher mid-run ends the other node's ranks within a minute, with a non-zero exit and a line
that says what happened.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import psutil
import pytest

from conftest import FAST_TRAINING, TINY_CITY, run_dir, script
from test_distributed_equivalence import assert_same_training, load
from test_faults import workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(port: int, out: Path, steps: int, extra: List[str] = ()) -> List[str]:
    """What a user types on each node (README): the same line everywhere."""
    return [sys.executable, "-m", "odin_ns.cli.train", "--ranks", "1", "--nnodes", "2", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "odin", "--output-dir", str(out), *FAST_TRAINING,
            "--max-num-iterations", str(steps), *extra, *TINY_CITY]


def start_node(cmd: List[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as stderr:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)


def stop_all(nodes: List[subprocess.Popen]) -> None:
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=30)


def test_two_nodes_started_apart_make_one_run(tmp_path, runs):
    out = tmp_path / "out"
    cmd = node_command(free_port(), out, 30)
    nodes = []
    try:
        nodes.append(start_node(cmd, tmp_path / "node0.txt"))
        time.sleep(4)  # the second node comes up later (any time within torchrun's rendezvous timeout)
        nodes.append(start_node(cmd, tmp_path / "node1.txt"))
        codes = [node.wait(timeout=600) for node in nodes]
    finally:
        stop_all(nodes)
    logs = [(tmp_path / f"node{i}.txt").read_text() for i in range(2)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    run = run_dir(out)  # exactly one run folder (one config.yml)
    assert len(glob.glob(str(run / "nerfstudio_models" / "*.ckpt"))) == 1
    assert len(glob.glob(str(out / "**" / "odin_stats.json"), recursive=True)) == 1
    stats = json.loads((run / "odin_stats.json").read_text())
    assert stats["summary"]["ranks"] == 2 and {r["rank"] for r in stats["steps"]} == {0, 1}
    result = tmp_path / "eval.json"
    subprocess.run([script("ns-eval"), "--load-config", str(run / "config.yml"), "--output-path", str(result)],
                   check=True, capture_output=True, timeout=300)
    # what the two nodes trained is what one node's 2 ranks train, bit for bit (the held-out PSNR too): the nodes
    # trained the schedule, not just ran
    one_node = runs.get(2, "odin", [*FAST_TRAINING, "--max-num-iterations", "30", *TINY_CITY])
    assert_same_training(load(out), load(one_node))
    again = tmp_path / "eval-one-node.json"
    subprocess.run([script("ns-eval"), "--load-config", str(run_dir(one_node) / "config.yml"), "--output-path",
                    str(again)], check=True, capture_output=True, timeout=300)
    mine, theirs = (json.loads(f.read_text())["results"] for f in (result, again))
    assert (mine["psnr"], mine["ssim"]) == (theirs["psnr"], theirs["ssim"])
    assert not any("configuration different" in log for log in logs)


def test_a_real_mismatch_between_nodes_is_refused_in_one_line(tmp_path):
    port = free_port()
    nodes = []
    try:
        nodes.append(start_node(node_command(port, tmp_path / "out", 5), tmp_path / "node0.txt"))
        nodes.append(start_node(node_command(port, tmp_path / "out", 5, ["--pipeline.block-size", "128"]),
                                tmp_path / "node1.txt"))
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        stop_all(nodes)
    for i, code in enumerate(codes):
        log = (tmp_path / f"node{i}.txt").read_text()
        assert code != 0, log[-2000:]
        errors = [line for line in log.splitlines() if line.startswith("odin: error:")]
        assert len(errors) == 1 and "configuration different" in errors[0], log[-3000:]


@pytest.mark.parametrize("killed", [0, 1])
def test_killing_one_nodes_launcher_ends_the_other_node(tmp_path, killed):
    """Node 0 starts first and so holds the rendezvous store (torchrun's c10d backend): killing it also takes
    the store from the survivor's torchrun; killing node 1 leaves the store."""
    out = tmp_path / "out"
    cmd = node_command(free_port(), out, 100000, ["--steps-per-save", "5", "--pipeline.model.stop-split-at", "0"])
    nodes = []
    try:
        nodes.append(start_node(cmd, tmp_path / "node0.txt"))
        time.sleep(3)
        nodes.append(start_node(cmd, tmp_path / "node1.txt"))
        deadline = time.time() + 300
        while not glob.glob(str(out / "**" / "step-*.ckpt"), recursive=True):  # training is under way
            assert time.time() < deadline and all(n.poll() is None for n in nodes), \
                (tmp_path / "node0.txt").read_text()[-3000:]
            time.sleep(0.2)
        survivor = 1 - killed
        survivor_ranks = list(workers(nodes[survivor]).values())
        assert len(survivor_ranks) == 1
        killed_at = time.time()
        os.kill(nodes[killed].pid, signal.SIGKILL)  # one node's launcher (its torchrun and rank die with it)
        code = nodes[survivor].wait(timeout=90)
        took = time.time() - killed_at
    finally:
        stop_all(nodes)
    log = (tmp_path / f"node{survivor}.txt").read_text()
    assert code != 0 and took < 60, (code, took, log[-3000:])
    _, alive = psutil.wait_procs(survivor_ranks, timeout=10)
    assert not alive, "a rank of the surviving node is still running"
    errors = [line for line in log.splitlines() if line.startswith("odin: error:")]
    assert errors and "lost" in errors[-1] and "another node" in errors[-1], log[-3000:]
    assert len(errors) == 1, log[-3000:]
