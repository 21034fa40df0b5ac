"""Ranks started with different configurations stop with one line naming the odd ranks (real gloo processes); CPU
ranks whose kernels run at different vector widths get a warning with the fix."""

from __future__ import annotations

import torch

from gloo_ranks import run_ranks

from odin_ns.runtime.config_check import check_same_config, cpu_kernels, kernels_warning
from odin_ns.errors import OdinInputError


def _rank(rank: int, world: int, results, configs, kernels=None, cpu=True):
    try:
        warning = check_same_config(configs[rank], rank, world, cpu=cpu, kernels=kernels and kernels[rank])
        results[rank] = "same" if warning is None else warning
    except OdinInputError as err:
        results[rank] = err.message


def _run(configs):
    return run_ranks(_rank, len(configs), configs)


def test_identical_configs_pass():
    results = _run([{"lr": 1.0, "steps": 3}] * 2)
    assert results == {0: "same", 1: "same"}


def test_a_different_rank_is_named_on_every_rank():
    results = _run([{"lr": 1.0}, {"lr": 1.0}, {"lr": 2.0}])
    assert set(results) == {0, 1, 2}
    for message in results.values():
        assert "ranks [2]" in message and "\n" not in message


def test_cpu_ranks_whose_kernels_differ_are_told_how_to_make_them_alike():
    # alike in torch, not in MKL
    widths = [("x86_64", "AVX2", "AVX2", ""), ("x86_64", "AVX2", "AVX512", ""), ("x86_64", "AVX2", "AVX2", "")]
    results = run_ranks(_rank, 3, [{"lr": 1.0}] * 3, widths)
    assert results[0] == results[1] == results[2]
    message = results[0]
    assert "(processor AVX2) on rank(s) [0, 2]" in message and "(processor AVX512) on rank(s) [1]" in message
    assert "ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=AVX2" in message and "\n" not in message
    assert run_ranks(_rank, 2, [{"lr": 1.0}] * 2, widths[:2], False) == {0: "same", 1: "same"}  # GPU ranks
    # MKL's set alike on every rank: the processors' widths no longer matter; torch's own widths still do
    assert kernels_warning([("x86_64", "AVX2", "AVX2", "AVX2"), ("x86_64", "AVX2", "AVX512", "AVX2")]) is None
    assert "ATEN_CPU_CAPABILITY=default and MKL_CBWR=COMPATIBLE" in kernels_warning(
        [("x86_64", "AVX512", "AVX512", ""), ("x86_64", "DEFAULT", "AVX512", "")])
    assert "processors of one kind" in kernels_warning(
        [("x86_64", "AVX2", "AVX2", ""), ("aarch64", "DEFAULT", "DEFAULT", "")])
    arch, width, widest, _ = cpu_kernels()  # this process's, as a rank reports it
    assert width == torch.backends.cpu.get_cpu_capability().replace("NO AVX", "DEFAULT") and arch and widest
