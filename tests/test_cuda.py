"""The CUDA path (`make gpu-check`; skipped on a machine without CUDA): gsplat's kernels against the CPU
rasterizer on the same scene, one rank training on the GPU, and NCCL ranks where the machine has a GPU per rank.

Tolerances: gsplat and the CPU rasterizer compute the same float32 formulas in different orders (per-tile
shared-memory batches against dense PyTorch ops), so pixels agree to about 1e-5 and a rare pixel at a cut-off
(alpha < 1/255, T <= 1e-4) to one splat's contribution: max |diff| < 2e-2, mean < 1e-4; gradients relative
to their largest < 1e-2 (the parameters of big splats, where both sums are long). NCCL ranks against one GPU
process: the same result within 1e-5 relative (atomic adds in gsplat's backward make CUDA runs
non-deterministic; the CPU path is the one that is bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAST_TRAINING, TINY_CITY, last_checkpoint, odin_train
from test_render_reference import PARAMS, make_scene

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check)")]

CUDA_TRAINING = FAST_TRAINING + ["--machine.device-type", "cuda", "--max-num-iterations", "30"]


def _render(p, device):
    from odin_ns.render import rasterization

    leaves = {k: p[k].float().to(device).requires_grad_(True) for k in PARAMS}
    colors, alphas, _ = rasterization(
        leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"], leaves["colors"],
        p["viewmats"].float().to(device), p["Ks"].float().to(device), p["width"], p["height"], sh_degree=3,
        backgrounds=leaves["backgrounds"])
    (colors.square().sum() + alphas.sum()).backward()
    return colors.detach().cpu(), {k: v.grad.cpu() for k, v in leaves.items()}


def test_gsplat_kernels_match_the_cpu_rasterizer():
    p = make_scene()
    cpu, cpu_grads = _render(p, "cpu")
    gpu, gpu_grads = _render(p, "cuda")
    diff = (cpu - gpu).abs()
    assert diff.max() < 2e-2 and diff.mean() < 1e-4, (diff.max().item(), diff.mean().item())
    for name in PARAMS:
        scale = cpu_grads[name].abs().max().clamp_min(1e-12)
        assert ((cpu_grads[name] - gpu_grads[name]).abs().max() / scale) < 1e-2, name


def test_selective_adam_on_the_gpu_is_torchs_fused_adam_and_a_rows_bits_do_not_depend_on_its_place():
    """On CUDA `fused_adam_` runs torch's fused kernel on the tensors as they are: every visible row is
    `torch.optim.Adam(fused=True)`'s bits, and a row updated inside a slice (gathered rows: the owner's update)
    gets the bits it gets in the whole parameter."""
    from odin_ns.scene.selective_adam import SelectiveAdam

    g = torch.Generator().manual_seed(8)
    n = 1003
    p0, grad = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g) * 1e-3
    ours, ref = torch.nn.Parameter(p0.cuda()), torch.nn.Parameter(p0.cuda())
    opt = SelectiveAdam([ours], lr=1e-2, eps=1e-15)
    opt_ref = torch.optim.Adam([ref], lr=1e-2, eps=1e-15, fused=True)
    for t in range(5):
        ours.grad, ref.grad = grad.cuda() * (t + 1), grad.cuda() * (t + 1)
        opt.step()
        opt_ref.step()
    assert torch.equal(ours, ref)
    part = torch.nn.Parameter(p0.cuda())
    part_opt = SelectiveAdam([part], lr=1e-2, eps=1e-15)
    rows = torch.arange(5, 998, 3, device="cuda")
    for t in range(5):
        part_opt.step_rows(rows, grad.cuda()[rows] * (t + 1))
    whole = torch.nn.Parameter(p0.cuda())
    whole_opt = SelectiveAdam([whole], lr=1e-2, eps=1e-15)
    for t in range(5):
        whole.grad = grad.cuda() * (t + 1)
        whole_opt.step()
    assert torch.equal(part[rows], whole[rows])
    assert torch.equal(part[:5], p0[:5].cuda())  # rows not touched stay


def test_one_rank_trains_on_the_gpu(tmp_path):
    odin_train(1, "odin", CUDA_TRAINING + TINY_CITY, tmp_path / "one")
    state = torch.load(last_checkpoint(tmp_path / "one"), map_location="cpu")
    assert state["step"] == 29 and torch.isfinite(state["pipeline"]["_model.gauss_params.means"]).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank (it refuses two ranks on one)")
def test_nccl_odin_equals_barrier_and_one_process(tmp_path):
    odin_train(2, "odin", CUDA_TRAINING + TINY_CITY, tmp_path / "odin")
    odin_train(2, "odin-barrier", CUDA_TRAINING + TINY_CITY, tmp_path / "barrier")
    odin_train(1, "odin-barrier", CUDA_TRAINING + ["--pipeline.micro-batch", "2"] + TINY_CITY, tmp_path / "ref")
    runs = [torch.load(last_checkpoint(tmp_path / n), map_location="cpu") for n in ("odin", "barrier", "ref")]
    for name in ("means", "scales", "quats", "features_dc", "opacities"):
        ref = runs[2]["pipeline"][f"_model.gauss_params.{name}"]
        for other in runs[:2]:
            x = other["pipeline"][f"_model.gauss_params.{name}"]
            assert x.shape == ref.shape, name
            assert ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12)) < 1e-5, name
