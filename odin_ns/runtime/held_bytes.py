"""The message buffers a rank holds at once: each buffer counted from when it is made until it is freed.

A step's messages do not all live together: a view's received splats are let go after its backward, a send's
buffer when the transport has taken it, a reader's gradients when the owner's update has summed them. Summing a
step's traffic would count them as if they did. Here every message buffer (what the channels send and receive, a
view's gradients from their backward on) is registered once, with a finalizer that takes its bytes off when
Python and the transport have both let the tensor go (torch keeps a tensor's Python object while C++ still holds
it: a pending send, a view of it), so `peak` is the most bytes of message buffers alive at once, as they were.
A view of a buffer counts as its base, whole. Written here: torch's memory statistics cover CUDA devices only,
and would count every tensor of the process, not the messages.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict

import torch


class HeldBytes:
    """Bytes of the registered tensors now alive, and the most since `take_peak`. Thread-safe: a lane on a thread
    and the transport free buffers too."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run inside `hold` (a collection while it allocates)
        self._alive: Dict[int, int] = {}  # id of a held tensor -> its bytes (an id is taken off when it is freed)
        self.now = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s buffer (its base's, for a view) until it is freed; once however often it is held."""
        base = tensor._base if tensor._base is not None else tensor
        key = id(base)
        size = base.untyped_storage().nbytes()
        with self._lock:
            if key in self._alive or not size:
                return
            self._alive[key] = size
            self.now += size
            self.peak = max(self.peak, self.now)
        weakref.finalize(base, self._freed, key)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.now -= self._alive.pop(key, 0)

    def take_peak(self) -> int:
        """The most held since the last call (the next period starts from what is held now)."""
        with self._lock:
            peak, self.peak = self.peak, self.now
        return peak
