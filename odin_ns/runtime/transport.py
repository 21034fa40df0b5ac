"""Point-to-point transport of a rank: messages matched by their order on each pair of ranks, never by tag.

NCCL matches the point-to-point messages between two ranks in the order they were posted and ignores tags
(pytorch/pytorch issues 94819 and 125079); gloo is run with the same discipline (every tag 0), so that the CPU
tests exercise what NCCL does. Every rank derives the same plan from replicated data (the action lists), which
fixes the order of the messages on every pair; one thread of a rank posts them (`Channels`), in that order, and
the sends and receives of an action group go out together in one `batch_isend_irecv`. A message whose size
depends on the data is a fixed-size header (its length fixed by the plan) followed by the payload it announces.

`exchange` and `all_gather_rows` move whole shards and a phase's read sets at phase boundaries (both sides know
the shapes).
torch.distributed does the transport (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from odin_ns.runtime.send_reaper import SendReaper
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
            log.held.hold(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, peer))
            sent_bytes += tensor.numel() * tensor.element_size()
        if peer in received and received[peer].numel() > 0:
            log.held.hold(received[peer])
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


def all_gather_rows(rows: torch.Tensor, counts: Sequence[int], log: WaitLog, cause: str,
                    kind: Optional[str] = None) -> List[torch.Tensor]:
    """All-gather [n_r, D] tensors of per-rank row counts `counts` (known to all); returns each rank's rows.
    `kind` names the bytes in the step's traffic by kind (none: the phase boundary's own)."""
    width = rows.shape[1]
    longest = max(max(counts), 1)
    padded = torch.zeros((longest, width), dtype=rows.dtype, device=comm_device())
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    for t in [padded] + gathered:
        log.held.hold(t)
    with log.waiting(cause):
        dist.all_gather(gathered, padded)
    log.add_traffic(padded.numel() * padded.element_size() * (len(counts) - 1),
                    padded.numel() * padded.element_size() * (len(counts) - 1), kind)
    return [g[:n].to(rows.device) for g, n in zip(gathered, counts)]


def channels_group(timeout_s: float):
    """The channels' process group (every rank, made by every rank at start-up in the same order; its operations
    time out as the default group's, `--pipeline.dist-timeout-s`, where a new group's default is torch's), opened
    with one collective of every rank on it: a step's first batch of messages involves only the ranks it messages,
    and NCCL leaves a `batch_isend_irecv` that is its group's first collective call undefined unless every rank of
    the group takes part (torch's note on `batch_isend_irecv`; its communicator is made lazily, by every rank)."""
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    dist.all_reduce(torch.zeros(1, device=comm_device()), group=group)
    return group


RECORD_ENV = "ODIN_NS_RECORD_MESSAGES"  # set: every message of the run is recorded (test of the action lists)
# "0": on gloo too, every receive is posted when its handler needs it, as on NCCL (the tests run the GPUs' path of
# the receives on CPU ranks)
RECEIVES_AHEAD_ENV = "ODIN_NS_RECEIVES_AHEAD"


class Channels:
    """One rank's ordered point-to-point messages. `batch(sends, recvs)` posts the sends (kept alive until they
    complete: NCCL's until a later batch finds them done, gloo's until a thread that waits for them sees them
    delivered, `runtime.send_reaper`) and the receives in one `batch_isend_irecv` and waits for the receives; the
    time is the wait of the named cause. With recording on, every message is noted as (kind, step, peer,
    "send"/"recv") in posting order (payloads and headers of one message count once, as the header's).

    `batch(..., wait=False)` only posts the receives (`wait_for` them later; before they are needed only where
    `posts_ahead` allows it).

    The channels have a process group of their own (`group`: every rank, made once at start-up): collectives (the
    barrier's; the trainer's whole-model gathers and evaluations, which on several ranks run only at a phase's end)
    run on the default group and so never come between two messages of a pair that the order matches."""

    def __init__(self, device: torch.device, log: WaitLog, group=None):
        self.device = device
        self.log = log
        self.group = group
        self._pending: List[Tuple[dist.Work, torch.Tensor]] = []  # NCCL's works not completed yet, and their tensors
        self._reaper = SendReaper()  # gloo's sends, waited for in the background
        self.record: Optional[List[list]] = [] if os.environ.get(RECORD_ENV) else None

    def note(self, kind: str, step: int, peer: int, direction: str) -> None:
        if self.record is not None:
            self.record.append([kind, int(step), int(peer), direction])

    def batch(self, sends: Sequence[Tuple[int, torch.Tensor]], recvs: Sequence[Tuple[int, torch.Tensor]],
              cause: str, kind: str | None = None, wait: bool = True, ahead: bool = False) -> List[dist.Work]:
        """Post the sends and receives together and wait for the receives (`cause`); `kind` names what the sends
        carry in the traffic accounts (P or G). With `wait` False the receives are only posted (before they are
        needed, so that their senders' sends complete at once): `wait_for` the returned works later; `ahead`: they
        are posted before a handler needs them (counted as `receives_ahead`)."""
        ops: List[dist.P2POp] = []
        sent = received = 0
        for peer, tensor in sends:
            if tensor.numel() == 0:
                continue
            tensor = tensor.contiguous()
            self.log.held.hold(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, peer, group=self.group))
            sent += tensor.numel() * tensor.element_size()
        recv_ops = []
        for peer, tensor in recvs:
            if tensor.numel() == 0:
                continue
            self.log.held.hold(tensor)
            ops.append(dist.P2POp(dist.irecv, tensor, peer, group=self.group))
            recv_ops.append(len(ops) - 1)
            received += tensor.numel() * tensor.element_size()
        if not ops:
            return []
        if self.device.type == "cuda":  # NCCL coalesces a batch, one operation too: its works complete together,
            # sends and receives; never waited for on the host's behalf (a wait would hold the rank's stream until
            # the peer takes the sends), kept until a later batch finds them done
            works = dist.batch_isend_irecv(ops)
            self._pending += [(work, [op.tensor for op in ops]) for work in works]
            posted = list(works) if recv_ops else []
        else:  # gloo coalesces nothing: batch_isend_irecv would post each operation in turn, after checks that
            # cost as much again as the posting (about 60 against 25 us for a send and a receive); one work per
            # operation, a send's only complete when waited for (`runtime.send_reaper`)
            works = [op.op(op.tensor, op.peer, group=self.group) for op in ops]
            for op, work in zip(ops, works):
                if op.op is dist.isend:
                    self._reaper.add(op.peer, work, op.tensor)
            posted = [works[i] for i in recv_ops]
        self.log.add_traffic(sent, received, kind)
        self.log.current.receives += len(recv_ops)
        if ahead:
            self.log.current.receives_ahead += len(recv_ops)
        if wait:
            self.wait_for(posted, cause)
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        return posted

    @property
    def posts_ahead(self) -> bool:
        """Whether receives may be posted before they are needed: gloo's complete one by one, in any order of
        waiting; NCCL runs a rank's point-to-point batches in order on one stream, so a receive posted early
        would hold up the rank's own later sends until its peer sends (a cycle when the peer waits for them).
        `ODIN_NS_RECEIVES_AHEAD=0` makes gloo post them as NCCL does."""
        return self.device.type == "cpu" and os.environ.get(RECEIVES_AHEAD_ENV, "1") != "0"

    def wait_for(self, works: Sequence[dist.Work], cause: str) -> None:
        """Until receives posted earlier have arrived."""
        if works:
            with self.log.waiting(cause):
                for work in works:
                    work.wait()

    def flush(self, cause: str = "phase") -> None:
        """Wait until every send has been taken (at a phase boundary, where every receive has been posted)."""
        pending, self._pending = self._pending, []
        with self.log.waiting(cause):
            for work, _ in pending:
                work.wait()
            self._reaper.drain()

    def dump(self, path) -> None:
        if self.record is not None:
            path.write_text(json.dumps(self.record))
