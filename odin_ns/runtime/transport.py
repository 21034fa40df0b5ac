"""Point-to-point exchange of tensors whose shapes both sides know in advance.

Every rank derives the same communication plan from replicated data (the schedule, the block table), so a
message needs no header: the receiver allocates the buffer from the plan and both sides post their operations
in one `batch_isend_irecv`. torch.distributed does the transport (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from odin_ns.runtime.waits import WaitLog


def exchange(sends: Dict[int, torch.Tensor], recv_shapes: Dict[int, Tuple[int, ...]], dtype: torch.dtype,
             device: torch.device, log: WaitLog, cause: str) -> Dict[int, torch.Tensor]:
    """Send `sends[peer]` to each peer and receive a tensor of `recv_shapes[peer]` from each; empty ones skipped."""
    received = {peer: torch.empty(shape, dtype=dtype, device=device) for peer, shape in recv_shapes.items()}
    ops: List[dist.P2POp] = []
    sent_bytes = recv_bytes = 0
    for peer in sorted(set(sends) | set(received)):
        if peer in sends and sends[peer].numel() > 0:
            tensor = sends[peer].contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, peer))
            sent_bytes += tensor.numel() * tensor.element_size()
        if peer in received and received[peer].numel() > 0:
            ops.append(dist.P2POp(dist.irecv, received[peer], peer))
            recv_bytes += received[peer].numel() * received[peer].element_size()
    if ops:
        with log.waiting(cause):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
    log.add_traffic(sent_bytes, recv_bytes)
    return received


def comm_device() -> torch.device:
    """Where collective buffers must live: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(rows: torch.Tensor, counts: Sequence[int], log: WaitLog, cause: str) -> List[torch.Tensor]:
    """All-gather [n_r, D] tensors of per-rank row counts `counts` (known to all); returns each rank's rows."""
    width = rows.shape[1]
    longest = max(max(counts), 1)
    padded = torch.zeros((longest, width), dtype=rows.dtype, device=comm_device())
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    with log.waiting(cause):
        dist.all_gather(gathered, padded)
    log.add_traffic(padded.numel() * padded.element_size() * (len(counts) - 1),
                    padded.numel() * padded.element_size() * (len(counts) - 1))
    return [g[:n].to(rows.device) for g, n in zip(gathered, counts)]
