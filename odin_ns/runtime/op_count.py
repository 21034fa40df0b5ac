"""Count what a GPU would pay for the runtime's side of a step: tensor operations launched, and host syncs.

On a GPU every tensor operation that computes is a kernel launch (a few microseconds each, whatever its size), and
every read of a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, an output whose size
depends on the data: `nonzero`, boolean-mask indexing, `unique`, `repeat_interleave` without `output_size`) stalls
the stream until the device catches up. Neither depends on the machine, so both can be counted here, on the CPU:
- operations: every aten operation dispatched (`TorchDispatchMode`), except views and allocations, which launch
  no kernel;
- syncs: the data-dependent operations above (seen by the dispatcher) plus the Tensor methods that read values on
  the host (`tolist`, `cpu`, `numpy`: invisible to the dispatcher on a CPU tensor, seen by `TorchFunctionMode`).
  On the CPU a host-side bookkeeping tensor cannot be told from one that would live on the device, so every such
  read counts (an upper bound).
Written here: torch's profiler counts operations but not host reads of CPU tensors.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Dict, Iterator, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

COUNT_ENV = "ODIN_NS_COUNT_OPS"  # "FIRST:LAST": count the runtime's operations of these steps (odin-bench scale)

_NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "_to_copy_noop", "alias"}
_SYNC_DISPATCH = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                  "unique_consecutive", "equal", "is_nonzero"}
_SYNC_METHODS = {"tolist", "cpu", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}


def _base(func) -> str:
    return func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func)


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Dict[str, int]):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _base(func)
        if not getattr(func, "is_view", False) and name not in _NO_KERNEL:
            self.counts["ops"] += 1
        if name in _SYNC_DISPATCH and name != "_local_scalar_dense":  # that one is counted at the method
            self.counts["syncs"] += 1
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in (args[1] if len(args) > 1 else [])):
            self.counts["syncs"] += 1  # a boolean mask: the output size is the mask's count
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.counts["syncs"] += 1
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counts: Dict[str, int]):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _SYNC_METHODS:
            self.counts["syncs"] += 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """Counts, per step, the operations and syncs of the code run inside `counting()` (on this thread)."""

    def __init__(self, window: Tuple[int, int] | None):
        self.window = window
        self.counts = {"ops": 0, "syncs": 0}

    @classmethod
    def from_environment(cls) -> "OpCounter":
        text = os.environ.get(COUNT_ENV, "")
        if not text:
            return cls(None)
        first, _, last = text.partition(":")
        return cls((int(first), int(last or first)))

    def active(self, step: int) -> bool:
        return self.window is not None and self.window[0] <= step <= self.window[1]

    @contextmanager
    def counting(self, step: int) -> Iterator[None]:
        if not self.active(step):
            yield
            return
        with _Function(self.counts), _Dispatch(self.counts):
            yield

    @contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside is not counted (a phase's start or end inside a counted step)."""
        saved = dict(self.counts)
        try:
            yield
        finally:
            self.counts.update(saved)

    def take(self) -> Dict[str, int]:
        """The counts since the last take (reset)."""
        out, self.counts = dict(self.counts), {"ops": 0, "syncs": 0}
        return out
