"""Owner updates beside the render (throughput-first): a thread that applies each step's update when its gradients
are in.

With reads one version behind, a rank may render step t+1 from the version of update t-1 of another rank's
blocks. That only hides the other rank's lag if update t-1 is published while its owner renders step t: an owner
that must finish its render first (or wait for the late gradients before starting it) ties the ranks together
every step, exactly as the barrier does. So the updates of a throughput-first phase run on this thread: it takes
the steps in order, waits for their gradients, applies selective Adam, publishes, and keeps a copy of the owned
rows after every update, so that the render thread reads its own blocks at the version its read was admitted
at, whatever the thread has done since. When an update runs changes the timing, never a value.

Written here: torch.distributed has no owner-side update queue; the queue, the condition and the copies are
Python's threading and torch tensors.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Dict, Optional

import torch


class UpdateWorker:
    """Applies `update(step, *args)` in step order on a thread (it returns the packed owned rows after it, or
    None: then they are packed here); waits and copies for the render thread."""

    def __init__(self, update: Callable, rows: Callable[[], torch.Tensor]):
        self._update = update
        self._rows = rows
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._done = threading.Condition()
        self.applied = -1
        self.snapshots: Dict[int, torch.Tensor] = {}  # version (update step) -> packed owned rows after it
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="odin-updates", daemon=True)
        self._thread.start()

    def begin(self, applied: int, rows: torch.Tensor) -> None:
        """A phase starts with every update up to `applied` in (the thread is idle) and these owned rows."""
        with self._done:
            self.applied = applied
            self.snapshots = {applied: rows}

    def submit(self, step: int, *args) -> None:
        self._raise()
        self._queue.put((step, args))

    def wait(self, step: int) -> None:
        """Until update `step` is applied (or the thread failed: its error is raised here)."""
        with self._done:
            while self.applied < step and self.error is None:
                self._done.wait(timeout=1.0)
        self._raise()

    def rows(self, version: int) -> torch.Tensor:
        """The owned rows as they were after update `version` (waits for it); older copies are dropped."""
        self.wait(version)
        with self._done:
            for v in [v for v in self.snapshots if v < version]:
                del self.snapshots[v]
            return self.snapshots[version]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the owner update thread failed: {self.error}") from self.error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, args = item
            try:
                rows = self._update(step, *args)  # the packed rows it published, if it did
                if rows is None:
                    rows = self._rows()
            except BaseException as exc:  # noqa: BLE001 (handed to the render thread, which raises it)
                with self._done:
                    self.error = exc
                    self._done.notify_all()
                return
            with self._done:
                self.snapshots[step] = rows
                self.applied = step
                self._done.notify_all()
