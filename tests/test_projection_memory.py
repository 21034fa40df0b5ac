"""Which projections keep their graph (`runtime.projection_memory`): the modes' budgets and the budget's test.
The trainings that hold them to the same model bit for bit are in test_distributed_equivalence (a budget that keeps
some and makes others again, 3 ranks) and test_throughput (none kept)."""

import math

import torch

from odin_ns.runtime.projection_memory import GRAPH_ROW_BYTES, ProjectionMemory, device_memory, keep_budget

CPU = torch.device("cpu")  # on a GPU, `device_memory` is torch's total memory of the device


def test_the_modes_budgets():
    gpu = 80e9
    assert keep_budget("keep", 5.0, gpu, 4) == math.inf
    assert keep_budget("recompute", None, gpu, 4) == 0.0
    assert keep_budget("auto", None, gpu, 4) == 20e9  # a quarter of several GPUs' memory
    assert keep_budget("auto", None, device_memory(CPU), 4) == math.inf  # CPU ranks keep every graph
    assert keep_budget("auto", 2.5, None, 4) == keep_budget("auto", 2.5, gpu, 4) == 2.5e6  # a budget given holds
    assert keep_budget("auto", None, gpu, 1) == math.inf  # one GPU: plain training's graphs


def test_graphs_are_kept_within_the_budget_priced_by_the_most_a_row_held():
    memory = ProjectionMemory(10 * GRAPH_ROW_BYTES)
    assert memory.keep(0, 10)  # exactly the budget, at the prior
    assert not memory.keep(1, 10)  # one byte over
    memory.learn(4, 4 * 2 * GRAPH_ROW_BYTES)  # a kept projection held twice the prior a row
    assert not memory.keep(0, 6) and memory.keep(0, 5)
    memory.learn(5, 5)  # a smaller one does not lower the price
    assert not memory.keep(0, 6)
    assert memory.take_counts() == (2, 3) and memory.take_counts() == (0, 0)
    assert not ProjectionMemory(0.0).keep(0, 0)  # recompute keeps no graph, even an empty one
    assert ProjectionMemory(math.inf).keep(10 ** 12, 10 ** 12)
