"""Buffers kept between steps.

On the CPU a fresh tensor the size of a step's rows costs its page faults at every step, about as much as the
arithmetic done in it (torch's CPU allocator keeps no cache; CUDA's caching allocator does this by itself, and
these cost it nothing). Written by hand for that reason: `kept_rows` for a buffer one owner reuses, `BufferPool`
for buffers handed from one thread to another.
"""

from __future__ import annotations

import collections
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


class BufferPool:
    """[rows, columns] buffers taken by one thread and given back by another (deque operations are atomic); a
    taken buffer is a view of the first rows of a free one large enough, or of a new one."""

    KEEP = 4

    def __init__(self) -> None:
        self._free: collections.deque = collections.deque()

    def take(self, rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for _ in range(len(self._free)):
            try:
                buf = self._free.popleft()
            except IndexError:
                break
            if buf.shape[0] >= rows and buf.shape[1] == columns and buf.dtype == dtype and buf.device == device:
                return buf[:rows]
            self._free.append(buf)
        return kept_rows(None, rows, (columns,), dtype, device)[:rows]

    def give(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        if len(self._free) < self.KEEP:
            self._free.append(base)
