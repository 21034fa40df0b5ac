"""Link models for the prediction: a message costs a latency plus its bytes over the sender's bandwidth.

The presets are published or measured figures, not fitted to what they predict:
- nvlink: NVLink 4 between H100 SXM GPUs of one node: nccl-tests all-reduce bus bandwidth ~460-480 GB/s on 8
  GPUs (NVIDIA/nccl-tests results and issues); small-message latency within a node ~3-10 us.
- pcie: GPUs on PCIe 4.0 x16 (the paper's RTX 4090 test bed): ~25 GB/s a direction achieved of the 32 GB/s peak
  (PCI-SIG 16 GT/s x16); small messages ~10 us.
- infiniband: one NDR 400 Gb/s NIC per GPU between nodes: ~48 GB/s (nccl-tests over NDR); ~10 us.
- loopback: gloo between processes of this 2-core machine: ~0.15-0.2 ms round trip for a small message and
  ~0.6 ms for 1 MiB (measured, DESIGN.md), i.e. ~0.3 ms per message as the replay of real runs uses it
  (`costs.MESSAGE_LATENCY_S`) and ~2.3 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class Link:
    name: str
    latency_s: float
    bandwidth: float  # bytes per second, one direction, per sender
    source: str


LINKS: Dict[str, Link] = {link.name: link for link in (
    Link("nvlink", 5e-6, 460e9, "H100 NVLink 4, nccl-tests bus bandwidth ~460-480 GB/s, latency 3-10 us"),
    Link("pcie", 10e-6, 25e9, "PCIe 4.0 x16, ~25 GB/s achieved of 32 GB/s, ~10 us"),
    Link("infiniband", 10e-6, 48e9, "InfiniBand NDR 400 Gb/s per GPU, ~48 GB/s (nccl-tests), ~10 us"),
    Link("loopback", 3e-4, 2.3e9, "gloo on this machine's loopback, ~0.3 ms a message, ~2.3 GB/s (measured)"),
)}


def link(name: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r} (choose from {', '.join(LINKS)})")
    return LINKS[name]
