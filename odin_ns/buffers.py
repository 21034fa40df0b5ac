"""Buffers kept between steps.

On the CPU a fresh tensor the size of a step's rows costs its page faults at every step, about as much as the
arithmetic done in it (torch's CPU allocator keeps no cache; CUDA's caching allocator does this by itself, and
these cost it nothing). Written by hand for that reason: `kept_rows` for a buffer one owner reuses.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def kept_rows(buf: Optional[torch.Tensor], rows: int, tail: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """`buf` if it holds at least `rows` rows of shape `tail`, `dtype` and `device`, else a new buffer with a
    quarter more rows; the caller keeps what it gets back and narrows it to `rows` (`[:rows]`: contiguous)."""
    tail = tuple(tail)
    if (buf is None or buf.shape[0] < rows or tuple(buf.shape[1:]) != tail or buf.dtype != dtype
            or buf.device != device):
        buf = torch.empty((rows + rows // 4 + 1,) + tail, dtype=dtype, device=device)
    return buf
