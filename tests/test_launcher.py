"""odin-train's own argument checks and its reading of torchrun's failure summary (no ranks started)."""

from __future__ import annotations

import socket

from odin_ns.cli.train import build_command, failed_rank, main, split_args


def test_port_in_use_is_refused(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["--master-port", str(port), "odin-barrier"]) == 2
    assert f"port {port} is in use" in capsys.readouterr().err


def test_bad_rank_count_and_missing_method(capsys):
    assert main(["--ranks", "0", "odin"]) == 2
    assert "--ranks must be at least 1" in capsys.readouterr().err
    assert main(["--ranks", "2"]) == 2
    assert "name a method" in capsys.readouterr().err


def test_torchrun_flags_pass_through_and_training_args_follow_the_method():
    launcher, training = split_args(["--ranks", "2", "--nnodes", "2", "odin", "--max-num-iterations", "5"])
    assert launcher == ["--ranks", "2", "--nnodes", "2"] and training == ["odin", "--max-num-iterations", "5"]
    cmd = build_command(4, ["--nnodes", "2", "--rdzv-endpoint", "h:1"], training)
    assert "--standalone" not in cmd and "--nproc-per-node=4" in cmd
    assert cmd[cmd.index("-m", 3) + 1:] == ["odin_ns.cli.worker", "odin", "--max-num-iterations", "5"]
    assert "--standalone" in build_command(2, [], training)


def test_root_cause_rank_is_named():
    summary = """Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 2)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1)
"""
    assert failed_rank(summary) == "0"
    assert failed_rank("nothing useful") is None
