"""A user's mistake through `odin-train` (2 real ranks): one `odin: error:` line on stderr, printed once whatever
the rank count, a non-zero exit, and nothing already written lost. Also a checkpoint that cannot be read (the newest
complete one is offered, or resumed from with a notice) and a checkpoint of another scene."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from conftest import FAST_TRAINING, TINY_CITY, last_checkpoint, odin_train

QUICK = FAST_TRAINING + ["--pipeline.model.stop-split-at", "0"]


def launch(ranks: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "odin_ns.cli.train", "--ranks", str(ranks), *args],
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The run failed, and its whole stderr is one line: the error."""
    assert proc.returncode not in (0, None), proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("odin: error:"), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("args,words", [
    (["odin", "--data", "/nonexistent/scene"], "does not exist"),
    (["odin-throughput", "--pipeline.max-staleness", "-2"], "--pipeline.max-staleness"),
])
def test_bad_input_is_one_line_from_two_ranks(tmp_path, args, words):
    out = tmp_path / "out"
    line = one_error_line(launch(2, *args, "--output-dir", str(out), "--vis", "tensorboard"))
    assert words in line
    if args[1].startswith("--pipeline."):
        assert not out.exists(), "a flag refused at parse time wrote output"


@pytest.mark.parametrize("option,value", [("block_size", 0), ("micro_batch", -1), ("phase_length", 0),
                                          ("dist_timeout_s", 0.0), ("viewer_refresh_every", 0)])
def test_out_of_range_options_are_refused_when_parsed(option, value):
    """What the parse of every rank does (the dataclass check); the 2-rank path of such an error is above."""
    from odin_ns.errors import OdinInputError
    from odin_ns.pipeline import OdinPipelineConfig

    with pytest.raises(OdinInputError, match="--pipeline." + option.replace("_", "-")):
        OdinPipelineConfig(**{option: value})


def test_viewer_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        line = one_error_line(launch(2, "odin", "--output-dir", str(tmp_path / "out"), "--viewer.websocket-host",
                                     "127.0.0.1", "--viewer.websocket-port", str(port), *QUICK[2:], *TINY_CITY))
    assert f"--viewer.websocket-port {port} is in use" in line


def test_bad_rank_count_is_one_line(tmp_path):
    assert "--ranks" in one_error_line(launch(2, "--ranks", "two", "odin"))
    assert "--ranks" in one_error_line(launch(0, "odin"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 1-rank run with checkpoints at steps 4 and 9, and a copy of the latter cut short as step 14."""
    out = tmp_path_factory.mktemp("ckpt")
    odin_train(1, "odin", QUICK + ["--max-num-iterations", "10", "--steps-per-save", "4",
                                   "--save-only-latest-checkpoint", "False"] + TINY_CITY, out)
    folder = last_checkpoint(out).parent
    good = folder / "step-000000009.ckpt"
    data = good.read_bytes()
    (folder / "step-000000014.ckpt").write_bytes(data[: len(data) // 2])
    return folder


def test_truncated_newest_checkpoint_resumes_from_the_complete_one(checkpoints, tmp_path):
    before = sorted(p.name for p in checkpoints.iterdir())
    proc = odin_train(1, "odin", QUICK + ["--max-num-iterations", "2", "--load-dir", str(checkpoints)] + TINY_CITY,
                      tmp_path / "resumed")
    notice = [line for line in proc.stderr.splitlines() if line.startswith("odin: notice:")]
    assert len(notice) == 1 and "step-000000009.ckpt" in notice[0] and "step-000000014.ckpt" in notice[0]
    assert torch.load(last_checkpoint(tmp_path / "resumed"), map_location="cpu")["step"] == 11
    assert sorted(p.name for p in checkpoints.iterdir()) == before, "a resume changed the checkpoints it read"


def test_truncated_checkpoint_asked_for_is_named_and_the_complete_one_offered(checkpoints, tmp_path):
    line = one_error_line(launch(2, "odin", *QUICK, "--output-dir", str(tmp_path / "out"), "--load-dir",
                                 str(checkpoints), "--load-step", "14", *TINY_CITY))
    assert "step-000000014.ckpt cannot be read" in line and "step-000000009.ckpt (--load-step 9)" in line


def test_checkpoint_of_another_scene_is_refused(checkpoints, tmp_path):
    other = [a if a != "12" else "10" for a in TINY_CITY]  # fewer street cameras: another capture
    assert other != TINY_CITY
    line = one_error_line(launch(2, "odin", *QUICK, "--output-dir", str(tmp_path / "out"), "--load-dir",
                                 str(checkpoints), "--load-step", "9", *other))
    assert "was trained on" in line and "but this run trains on" in line and "training views" in line
