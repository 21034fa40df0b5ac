"""Bad input ends in one line that says what to do, a non-zero exit, and nothing already written is lost."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import FOX, script
from odin_ns.data.auto_dataparser import detect_parser
from odin_ns.errors import OdinInputError


def ns_train(*args, timeout=180):
    return subprocess.run([script("ns-train"), *args], capture_output=True, text=True, timeout=timeout)


def test_missing_data_folder_fails_in_one_line(tmp_path):
    proc = ns_train("odin", "--data", str(tmp_path / "nope"), "--vis", "tensorboard",
                    "--output-dir", str(tmp_path / "out"))
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("odin: error:")]
    assert len(lines) == 1 and "does not exist" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_empty_and_unknown_layouts(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OdinInputError, match="is empty"):
        detect_parser(empty)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    with pytest.raises(OdinInputError, match="no dataset layout recognised"):
        detect_parser(tmp_path / "junk")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "transforms.json").write_text("{not json")
    with pytest.raises(OdinInputError, match="cannot read"):
        detect_parser(tmp_path / "bad")


@pytest.mark.skipif(not (FOX / "transforms.json").exists(), reason="the shared fox photos are not present")
def test_detects_instant_ngp(tmp_path):
    assert type(detect_parser(FOX)).__name__ == "InstantNGPDataParserConfig"


@pytest.mark.skipif(not (FOX / "transforms.json").exists(), reason="the shared fox photos are not present")
def test_corrupt_image_is_named(tmp_path):
    data = tmp_path / "fox"
    (data / "images").mkdir(parents=True)
    meta = json.loads((FOX / "transforms.json").read_text())
    frames = [f for f in meta["frames"] if (FOX / f["file_path"]).exists()][:6]
    for f in frames:
        shutil.copy(FOX / f["file_path"], data / f["file_path"])
    broken = data / frames[2]["file_path"]
    broken.write_bytes(b"this is not a jpeg")
    meta["frames"] = frames
    (data / "transforms.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    proc = ns_train("odin", "--data", str(data), "--vis", "tensorboard", "--output-dir", str(out),
                    "--max-num-iterations", "3", "--pipeline.datamanager.camera-res-scale-factor", "0.1",
                    "--pipeline.model.random-init", "True", "--pipeline.model.num-random", "500")
    assert proc.returncode != 0
    error = [l for l in proc.stderr.splitlines() if l.startswith("odin: error:")]
    assert error and broken.name in error[0], proc.stderr[-3000:]
    assert list(out.glob("**/config.yml")), "the run's config written before the failure must stay"
