"""Throughput-first: the versions of a rank's own rows that its renders read, kept by copying the touched rows.

Throughput-first's owner updates run on the communication lane, beside the render, and a step may render its own
blocks one update behind. The render therefore reads its own rows from a mirror that the lane never writes: the
mirror holds the rows at one version, and each update the lane finishes leaves the rows it changed (their values
after it) in a log. Before a render reads version v, the render's thread moves the mirror forward to v, applying
the logged rows of the versions in between with one `index_copy_` each. The versions a rank reads only grow (the
lane admits a version from the last one read on), so the mirror never goes back.

Per update this copies the touched rows once (what changed), where a snapshot of the whole shard per update would
copy every owned row; the whole shard is copied once per phase, when the mirror starts.
"""

from __future__ import annotations

import threading
from typing import Dict, Tuple

import torch


class OwnedVersions:
    """A mirror of the rank's packed own rows at one version, and the touched rows of each later update."""

    def __init__(self, packed: torch.Tensor, version: int):
        """`packed`: the own rows at `version`, a tensor of the mirror's own (not the parameters)."""
        self.rows = packed
        self.version = version
        self._log: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def latest(self) -> int:
        """The newest version recorded (the mirror's own when none is)."""
        with self._lock:
            return max(self._log, default=self.version)

    def record(self, version: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """The lane, after update `version`: the owned rows it changed and their packed values after it (kept:
        the caller's tensors may be buffers it reuses)."""
        with self._lock:
            self._log[version] = (rows, values.clone())

    def at(self, version: int) -> torch.Tensor:
        """The packed own rows at `version` (the render's thread): the mirror, moved forward to it."""
        if version < self.version:
            raise RuntimeError(f"own rows at version {version} asked after version {self.version} was read")
        for v in range(self.version + 1, version + 1):
            with self._lock:
                entry = self._log.pop(v, None)
            if entry is None:
                raise RuntimeError(f"own rows at version {version}: update {v} was not recorded")
            self.rows.index_copy_(0, *entry)
        self.version = version
        return self.rows
