"""PSNR as torchmetrics' `PeakSignalNoiseRatio(data_range=1.0)` computes it, without importing torchmetrics.

splatfacto measures PSNR with torchmetrics, whose import (it pulls in its audio, plotting and matplotlib modules)
costs about 1.5 s in every rank at start-up, for one formula. The same formula (torchmetrics'
`_psnr_compute`, base 10) on the whole batch; LPIPS, when its weights are on disk, still comes from torchmetrics.
"""

from __future__ import annotations

import math

import torch


class PSNR:
    """Callable like torchmetrics' metric: `psnr(preds, target)` -> 0-d tensor in dB (data range 1)."""

    def __init__(self, data_range: float = 1.0):
        self.data_range = data_range

    def __call__(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        sum_squared_error = torch.sum((preds - target) ** 2)
        num_obs = target.numel()
        psnr_base_e = 2 * math.log(self.data_range) - torch.log(sum_squared_error / num_obs)
        return psnr_base_e * (10 / math.log(10.0))
