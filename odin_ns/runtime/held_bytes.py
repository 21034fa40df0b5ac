"""The message buffers a rank holds at once: each buffer counted from when it is made until it is freed.

A step's messages do not all live together: a view's received splats are let go after its backward, a send's buffer
when the transport has taken it, a reader's gradients when the owner's update has summed them. Summing a step's
traffic would count them as if they did. Here every message buffer (what the channels send and receive, a view's
gradients from their backward on) is registered once, with a finalizer that takes its bytes off when Python and the
transport have both let the tensor go (torch keeps a tensor's Python object while C++ still holds it: a pending
send), so `peak` is the most bytes of message buffers alive at once, as they were. A buffer is its storage, counted
once and whole, however many of its views are held. Written here: torch's memory statistics cover CUDA devices only,
and would count every tensor of the process, not the messages.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Set, Tuple

import torch


class HeldBytes:
    """Bytes of the registered buffers now alive, and the most since `take_peak`. Thread-safe: a lane on a thread
    and the transport free buffers too."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run inside `hold` (a collection while it allocates)
        # a held storage (its device and address) -> [its bytes, the held tensors that use it still alive]: a
        # storage counts once whatever aliases of it are held, until the last of them is freed (a storage cannot
        # be freed, nor its address reused, before)
        self._alive: Dict[Tuple[str, int], List[int]] = {}
        self._held: Set[int] = set()  # ids of the tensors held (an id is taken off when its tensor is freed)
        self.now = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage (whole) until every held tensor that uses it is freed; once however often the
        tensor or its aliases (views, detached copies) are held."""
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        key = (str(tensor.device), storage.data_ptr())
        with self._lock:
            if not size or id(tensor) in self._held:
                return
            self._held.add(id(tensor))
            entry = self._alive.get(key)
            if entry is None:
                self._alive[key] = [size, 1]
                self.now += size
                self.peak = max(self.peak, self.now)
            else:
                entry[1] += 1
        weakref.finalize(tensor, self._freed, key, id(tensor))

    def _freed(self, key: Tuple[str, int], tensor_id: int) -> None:
        with self._lock:
            self._held.discard(tensor_id)
            entry = self._alive[key]
            entry[1] -= 1
            if not entry[1]:
                del self._alive[key]
                self.now -= entry[0]

    def take_peak(self) -> int:
        """The most held since the last call (the next period starts from what is held now)."""
        with self._lock:
            peak, self.peak = self.peak, self.now
        return peak
