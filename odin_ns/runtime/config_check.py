"""Every rank must train the same configuration: compare a hash of it across ranks before any work starts."""

from __future__ import annotations

import hashlib
from typing import List, Optional

import torch.distributed as dist
import yaml

from odin_ns.errors import OdinInputError


def config_fingerprint(config) -> str:
    """A hash of the configuration as nerfstudio saves it (yaml)."""
    return hashlib.sha256(yaml.dump(config).encode()).hexdigest()[:16]


def check_same_config(config, rank: int, world_size: int) -> None:
    """All-gather the fingerprints; on a mismatch every rank stops with the same one-line error."""
    fingerprints: List[Optional[str]] = [None] * world_size
    dist.all_gather_object(fingerprints, config_fingerprint(config))
    odd = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
    if odd:
        raise OdinInputError(f"ranks {odd} were started with a configuration different from rank 0's "
                             "(every rank must get the same arguments)")
