"""Let a send's buffer go as soon as the transport has delivered it, where the transport cannot say so unasked.

gloo completes a send only once its receiver has posted the matching receive (the message moves then), and its
work reports completion only to `wait()`: `is_completed()` stays False until someone waits, and a wait with a
timeout closes the pair when it expires. A rank that kept its send works until the phase's end (where it waits
for them all) held every message it sent in the phase: 25 steps of splats and gradients by default. Here one
thread per peer waits for that peer's sends in posting order (the order its receives match them in, so the
oldest is always the next to complete) and drops each buffer once it is delivered; the rank's own thread never
blocks on a send. NCCL's works report completion as it happens (`Channels` prunes them itself), so only gloo
needs this. Written here: torch.distributed offers no completion callback for gloo's point-to-point works.
"""

from __future__ import annotations

import queue
import threading
from typing import Dict, Optional

import torch
import torch.distributed as dist


class SendReaper:
    """`add(peer, work, tensor)`: wait for the send in the background and let its tensor go; `drain()`: until every
    send added so far is delivered (a phase's end); `error`: the first failure of a wait (a peer that died: the
    rank's own receives report it where they wait). A wait has the process group's timeout, as the phase's flush had."""

    def __init__(self) -> None:
        self._queues: Dict[int, "queue.Queue"] = {}
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()

    def add(self, peer: int, work: dist.Work, tensor: torch.Tensor) -> None:
        q = self._queues.get(peer)
        if q is None:
            q = self._queues[peer] = queue.Queue()
            threading.Thread(target=self._run, args=(q,), name=f"odin-sends-to-{peer}", daemon=True).start()
        q.put((work, tensor))

    def _run(self, q: "queue.Queue") -> None:
        while True:
            item = q.get()
            try:
                item[0].wait()  # every send is waited for, even after a failure: a send to a live peer completes
                # once its receive is posted (dropped before, its tensor could be freed under the transport), one
                # to a lost peer fails at once
            except BaseException as exc:  # noqa: BLE001 (kept for the posting thread)
                with self._lock:
                    self.error = self.error or exc  # the first failure says what happened
            finally:
                item = None  # the work and its tensor go here, not at the next message
                q.task_done()

    def drain(self) -> None:
        for q in self._queues.values():
            q.join()
        if self.error is not None:
            raise self.error
