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
    assert memory.keep(10)  # exactly the budget, at the prior
    memory.kept_graph(4, 4 * 2 * GRAPH_ROW_BYTES)  # it held twice the prior a row: 8 rows' worth
    assert not memory.keep(2) and memory.keep(1)  # 8 + 2 x 2 (the new price) over 10; 8 + 2 within
    memory.release(4 * 2 * GRAPH_ROW_BYTES)
    assert not memory.keep(6) and memory.keep(5)  # priced at 2 prior rows a row now
    memory.kept_graph(5, 5)  # a smaller one does not lower the price
    memory.release(5)
    assert not memory.keep(6)
    assert memory.take_counts() == (3, 3) and memory.take_counts() == (0, 0)
    assert memory.held == 0
    assert not ProjectionMemory(0.0).keep(0)  # recompute keeps no graph, even an empty one
    assert ProjectionMemory(math.inf).keep(10 ** 12)
