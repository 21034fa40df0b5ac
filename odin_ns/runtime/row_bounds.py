"""The bounds a phase was planned with, as tables that a step's moved rows are tested against.

A phase's read sets hold while every mean stays within `motion[i]` of its block's box (lo, hi) and every scale
within exp(growth[i]) of its block's largest (`schedule.phase_planner.motion_bounds`). The owner tests the rows its
update moved at every step, so the bounds are made once per phase, per step and block: lo - motion, hi + motion
and the scale bound; a row's test is then a gather of its block's bounds and a comparison each. It decides as the
direct comparisons (mean >= lo - motion, mean <= hi + motion, the largest scale in float64 <= max_scale *
exp(growth) in float64) do, bit for bit: the bounds are the same elementwise operations on the block table that
the direct test makes on its gathered rows, the largest of three scales is within a bound exactly when all three
are, and a float32 scale is at most a float64 bound exactly when it is at most the largest float32 not above that
bound. A NaN is outside either way. When the moved rows are every owned row (a step whose views see the whole
share), the rows are taken as they lie, without gathering them. One host read a step.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


class RowBounds:
    """The bounds of one phase's steps for one rank's owned rows (`row_block`: each owned row's block)."""

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, max_scale: torch.Tensor, motion: Sequence[float],
                 growth: Sequence[float], row_block: torch.Tensor):
        motion_t = torch.tensor(list(motion), dtype=torch.float64).to(lo.device)[:, None, None]
        scale = max_scale.double()[None] * torch.tensor([math.exp(g) for g in growth], dtype=torch.float64,
                                                        device=lo.device)[:, None]
        scale32 = scale.float()  # the nearest float32; one step down where it lies above the float64 bound
        scale32 = torch.where(scale32.double() > scale, torch.nextafter(scale32, scale32.new_tensor(-math.inf)),
                              scale32)
        # [steps, blocks, 3] and [steps, blocks]; `lo - motion` as the direct test computes it (a float32 tensor
        # and a Python float)
        self.lo = (lo[None] - motion_t.float()).contiguous()
        self.hi = (hi[None] + motion_t.float()).contiguous()
        self.scale = scale32.contiguous()
        self.row_block = row_block

    def blocks_outside(self, i: int, rows: Optional[torch.Tensor], means: torch.Tensor,
                       log_scales: torch.Tensor) -> List[int]:
        """The blocks (ascending) of the rows `rows` (None: every owned row) whose mean or largest scale at step `i`
        of the phase lies outside the bounds; one host read."""
        return self.check(i, rows, means, log_scales)[0]

    def check(self, i: int, rows: Optional[torch.Tensor], means: torch.Tensor, log_scales: torch.Tensor,
              also: Optional[torch.Tensor] = None) -> Tuple[List[int], Optional[List[float]]]:
        """`blocks_outside` (`rows` None: every owned row, as they lie), whose one host read also brings back
        `also` (float64 values on the same device: throughput-first's evidence), with its values (None without)."""
        if rows is None:
            blocks, m, scales = self.row_block, means, log_scales.exp()
        else:
            blocks = self.row_block.index_select(0, rows)
            m = means.index_select(0, rows)
            scales = log_scales.index_select(0, rows).exp_()
        ok = (m >= self.lo[i].index_select(0, blocks)).all(dim=1)
        ok &= (m <= self.hi[i].index_select(0, blocks)).all(dim=1)
        ok &= scales.amax(dim=1) <= self.scale[i].index_select(0, blocks)
        if also is None:
            inside, values = bool(ok.all()), None
        else:
            read = torch.cat([ok.all().view(1).to(also.dtype), also]).tolist()
            inside, values = read[0] == 1.0, read[1:]
        if inside:
            return [], values
        return sorted(set(blocks[~ok].tolist())), values
