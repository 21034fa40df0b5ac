"""Which step's gradients each rank has sent: the inline lane's probe, read without a round trip where it can be.

Throughput-first's inline lane asks, before an update, whether every reader of the rank's blocks has already sent
its gradients of that step (`LaneDecisions._lane_probe`); each rank notes the last step whose gradients it sent. The
job's key-value store (torch.distributed's TCPStore) carries a note to every rank at a round trip per note and per
question: about 0.4 ms a step and rank in a profile of a 2-rank CPU run. Ranks on one host share their notes
through shared memory instead: each rank writes its note into a file of 8 bytes of its own (mapped, an aligned
8-byte store) that the other ranks of its host map and read; the store still carries the notes to ranks on other
hosts. A read that is behind only makes the probe answer "not yet" (the rank renders first and updates after):
the answer changes when the update runs, never what it computes. Written by hand: the store has no local fast path
and torch.distributed nothing of the kind.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import tempfile
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

SLOT = struct.Struct("<q")  # the last step whose gradients the rank sent (-1: none yet)


def _shared_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _own_slot(rank: int) -> Tuple[Optional[str], Optional[mmap.mmap]]:
    """This rank's file and its mapping, holding -1; (None, None) where no file can be made (the store then)."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"odin-lane-rank{rank}-", dir=_shared_dir())
        try:
            os.write(fd, SLOT.pack(-1))
            return path, mmap.mmap(fd, SLOT.size)
        finally:
            os.close(fd)
    except OSError:
        return None, None


def _peer_slot(path: str) -> Optional[mmap.mmap]:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return mmap.mmap(fd, SLOT.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except OSError:
        return None


class SentMarks:
    """The notes of every rank (see the module docstring). All ranks make theirs at start-up, together: each waits
    in the store for every other rank's host and file."""

    def __init__(self, store, rank: int, world_size: int, prefix: str, host: Optional[str] = None):
        self.store, self.rank, self.prefix = store, rank, prefix
        host = host or socket.gethostname()  # `host`: the name this rank gives (tests name other hosts)
        self._path, self._mine = _own_slot(rank)
        store.set(f"{prefix}{rank}", "-1")
        store.set(f"{prefix}where/{rank}", f"{host}\n{self._path or ''}")
        self._local: Dict[int, mmap.mmap] = {}
        for q in range(world_size):
            if q != rank:
                q_host, q_path = store.get(f"{prefix}where/{q}").decode().split("\n")
                slot = _peer_slot(q_path) if q_host == host and q_path else None
                if slot is not None:
                    self._local[q] = slot
        store.set(f"{prefix}opened/{rank}", ",".join(str(q) for q in sorted(self._local)))
        self._world = world_size
        self._to_store = True  # until every rank has said which notes it reads from memory (`_settle`)
        self._settled = False
        self._finalizer = weakref.finalize(self, _remove, self._path)

    def note(self, step: int) -> None:
        """This rank has sent its gradients of `step`."""
        if not self._settled:
            self._settle()
        if self._mine is not None:
            SLOT.pack_into(self._mine, 0, step)
        if self._to_store:
            self.store.set(f"{self.prefix}{self.rank}", str(step))

    def all_sent(self, ranks: Sequence[int], step: int) -> bool:
        """Whether every rank of `ranks` has noted `step` (or a later one)."""
        remote: List[int] = []
        for q in ranks:
            slot = self._local.get(q)
            if slot is None:
                remote.append(q)
            elif SLOT.unpack_from(slot, 0)[0] < step:
                return False
        if not remote:
            return True
        return all(int(v) >= step for v in self.store.multi_get([f"{self.prefix}{q}" for q in remote]))

    def _settle(self) -> None:
        """Once, at the first note (every rank made its notes at start-up, before the first step): which ranks read
        this rank's note from memory. The store carries it only if some rank does not; the file is removed once
        every rank that reads it has mapped it (a mapping outlives its name)."""
        readers = set()
        for q in range(self._world):
            if q != self.rank:
                opened = self.store.get(f"{self.prefix}opened/{q}").decode()
                if str(self.rank) in opened.split(","):
                    readers.add(q)
        self._to_store = self._mine is None or len(readers) < self._world - 1
        self._finalizer()
        self._settled = True

    @property
    def local_peers(self) -> List[int]:
        """The ranks whose notes this rank reads from memory."""
        return sorted(self._local)


def _remove(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
