"""`ns-train odin` alone on the CPU: real photos, a falling loss, rising held-out PSNR, densification, checkpoints.

Runs in-process (nerfstudio's own Trainer loop with the odin trainer) on the fox photos at 1/16 resolution, from
random Gaussians (instant-ngp data has no seed points), through nerfstudio's instant-ngp parser.
"""

from __future__ import annotations

import json

import pytest
import torch
import tyro

from nerfstudio.configs.method_configs import AnnotatedBaseConfigUnion

from conftest import FAST_TRAINING, FOX

STEPS = 200

pytestmark = pytest.mark.skipif(not (FOX / "transforms.json").exists(), reason="the shared fox photos are absent")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    args = ["odin", "--output-dir", str(out), "--max-num-iterations", str(STEPS), "--steps-per-save", "100",
            *FAST_TRAINING, "--pipeline.model.warmup-length", "50", "--pipeline.model.refine-every", "50",
            "--pipeline.model.sh-degree-interval", "100", "--pipeline.datamanager.data", str(FOX),
            "--pipeline.datamanager.camera-res-scale-factor", "0.0625", "--pipeline.model.random-init", "True",
            "--pipeline.model.num-random", "5000", "--pipeline.model.random-scale", "2.0", "instant-ngp-data"]
    config = tyro.cli(AnnotatedBaseConfigUnion, args=args)
    config.set_timestamp()
    config.save_config()
    trainer = config.setup(local_rank=0, world_size=1)
    trainer.setup()
    before = trainer.pipeline.get_average_eval_image_metrics(step=0)
    n_before = trainer.pipeline.model.num_points
    trainer.train()
    after = trainer.pipeline.get_average_eval_image_metrics(step=trainer.step)
    stats = json.loads((config.get_base_dir() / "odin_stats.json").read_text())
    return dict(config=config, trainer=trainer, before=before, after=after, n_before=n_before, stats=stats)


def test_loss_falls(run):
    losses = [r["loss"] for r in run["stats"]["steps"]]
    first, last = sum(losses[:15]) / 15, sum(losses[-15:]) / 15
    assert last < 0.8 * first, (first, last)


def test_held_out_psnr_rises(run):
    assert run["after"]["psnr"] > run["before"]["psnr"] + 4.0, (run["before"], run["after"])


def test_densification_ran(run):
    assert run["trainer"].pipeline.model.num_points != run["n_before"]


def test_checkpoints_are_plain_splatfacto(run):
    ckpts = sorted((run["config"].get_base_dir() / "nerfstudio_models").glob("step-*.ckpt"))
    assert [c.name for c in ckpts] == [f"step-{STEPS - 1:09d}.ckpt"]  # nerfstudio keeps only the latest
    state = torch.load(ckpts[-1], map_location="cpu")  # weights_only, as nerfstudio's tools load it
    model = run["trainer"].pipeline.model
    assert torch.equal(state["pipeline"]["_model.gauss_params.means"], model.gauss_params["means"].detach())
    assert state["optimizers"]["means"]["state"][0]["exp_avg"].shape == model.gauss_params["means"].shape


def test_stats_file_has_every_step(run):
    steps = run["stats"]["steps"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["compute_s"] > 0 and r["rank"] == 0 for r in steps)
    assert run["stats"]["summary"]["views_per_s"] > 0
