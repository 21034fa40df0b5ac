"""Densification and pruning block by block, with gsplat's strategy code.

gsplat's `DefaultStrategy` grows and prunes one flat set of Gaussians, drawing split samples from the global RNG
and appending new Gaussians at the end. Across ranks that order and those draws would depend on who owns what.
Here each block is refined on its own, by gsplat's own `_grow_gs` / `_prune_gs` (same criteria, same ops), with
the RNG seeded from (seed, step, block id), and the blocks are put back together in id order. The result depends
only on the block's contents: an owner refining its blocks and one process refining all of them get the same
Gaussians in the same order, bit for bit. What is written by hand is only this per-block framing.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from gsplat.strategy import DefaultStrategy

STATE_KEYS = ("grad2d", "count", "radii")


class _BlockOptimizer:
    """The two attributes gsplat's ops touch (`param_groups`, `state`) for one parameter of one block."""

    def __init__(self, param: torch.Tensor, state: Dict[str, torch.Tensor]):
        self.param_groups = [{"params": [param]}]
        self.state = {param: state}


def block_seed(seed: int, step: int, block: int) -> int:
    """A per-(step, block) RNG seed, independent of which rank refines the block."""
    return (seed * 1_000_003 + step * 7919 + block * 104_729) % (2**63 - 1)


@torch.no_grad()
def refine_blocks(
    strategy: DefaultStrategy,
    params: Dict[str, torch.Tensor],
    opt_states: Dict[str, Dict[str, torch.Tensor]],
    state: Dict[str, torch.Tensor],
    ranges: Sequence[Tuple[int, int, int]],
    step: int,
    seed: int,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]], Dict[str, torch.Tensor], List[int],
           Tuple[int, int, int]]:
    """Grow then prune each block (block id, start, stop) of the concatenated tensors, as gsplat would.

    Returns the new concatenated params, optimizer states (every key but "step"), strategy state, the new
    per-block counts, and (duplicated, split, pruned) totals.
    """
    names = list(params.keys())
    out_params: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
    out_opt: Dict[str, Dict[str, List[torch.Tensor]]] = {
        n: {k: [] for k in opt_states[n] if k != "step"} for n in names}
    out_state: Dict[str, List[torch.Tensor]] = {k: [] for k in STATE_KEYS if state.get(k) is not None}
    counts, totals = [], [0, 0, 0]
    for block, start, stop in ranges:
        bparams = {n: params[n][start:stop] for n in names}
        bopts = {n: _BlockOptimizer(bparams[n], {k: v[start:stop] for k, v in opt_states[n].items() if k != "step"})
                 for n in names}
        bstate = {k: state[k][start:stop] for k in out_state}
        bstate["scene_scale"] = state.get("scene_scale", 1.0)
        torch.manual_seed(block_seed(seed, step, block))
        n_dup, n_split = strategy._grow_gs(bparams, bopts, bstate, step)
        n_prune = strategy._prune_gs(bparams, bopts, bstate, step)
        totals[0] += n_dup
        totals[1] += n_split
        totals[2] += n_prune
        for n in names:
            p = bopts[n].param_groups[0]["params"][0]
            out_params[n].append(p.detach())
            for k, v in bopts[n].state[p].items():
                out_opt[n][k].append(v)
        for k in out_state:
            out_state[k].append(bstate[k])
        counts.append(int(bparams[names[0]].shape[0]))
    new_params = {n: torch.cat(v) for n, v in out_params.items()}
    new_opt = {n: {k: torch.cat(v) for k, v in d.items()} for n, d in out_opt.items()}
    new_state = {k: torch.zeros_like(torch.cat(v)) for k, v in out_state.items()}  # gsplat resets after refining
    return new_params, new_opt, new_state, counts, (totals[0], totals[1], totals[2])
