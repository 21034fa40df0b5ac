"""Registration through nerfstudio's entry points, nerfstudio's overrides, device choice, clear errors."""

from __future__ import annotations

import subprocess

import pytest
import torch
import tyro

from nerfstudio.configs.method_configs import AnnotatedBaseConfigUnion

from conftest import script
from odin_ns.errors import OdinInputError
from odin_ns.scene.selective_adam import SelectiveAdam
from odin_ns.trainer import OdinTrainerConfig, check_device


def test_ns_train_lists_the_three_methods():
    out = subprocess.run([script("ns-train"), "--help"], capture_output=True, text=True, timeout=120).stdout
    for method in ("odin", "odin-throughput", "odin-barrier"):
        assert f"│ {method} " in out or f" {method} " in out, method


@pytest.mark.parametrize("method,policy", [("odin", "quality"), ("odin-throughput", "throughput"),
                                           ("odin-barrier", "barrier")])
def test_usual_overrides_reach_the_config(method, policy):
    config = tyro.cli(AnnotatedBaseConfigUnion, args=[
        method, "--max-num-iterations", "7", "--pipeline.model.sh-degree", "1",
        "--pipeline.datamanager.camera-res-scale-factor", "0.5", "--vis", "tensorboard",
        "--pipeline.micro-batch", "2", "instant-ngp-data", "--data", "somewhere"])
    assert isinstance(config, OdinTrainerConfig)
    assert config.method_name == method and config.pipeline.policy == policy
    assert config.max_num_iterations == 7 and config.pipeline.model.sh_degree == 1
    assert config.pipeline.datamanager.camera_res_scale_factor == 0.5
    assert config.pipeline.micro_batch == 2 and config.vis == "tensorboard"
    assert type(config.pipeline.datamanager.dataparser).__name__ == "InstantNGPDataParserConfig"
    assert config.optimizers["means"]["optimizer"].setup([torch.nn.Parameter(torch.zeros(2, 3))]).__class__ \
        is SelectiveAdam


def test_default_data_is_the_built_in_scene_and_device_follows_the_machine():
    config = tyro.cli(AnnotatedBaseConfigUnion, args=["odin"])
    parser = config.pipeline.datamanager.dataparser
    assert type(parser).__name__ == "OdinAutoDataParserConfig" and parser.data is None
    assert type(parser.resolve()).__name__ == "OdinCityDataParserConfig"
    assert config.machine.device_type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_one_line_error():
    with pytest.raises(OdinInputError) as err:
        check_device("cuda")
    assert "--machine.device-type" in err.value.message and "\n" not in err.value.message
