"""Join or start the process group that the ranks of one training share.

Three ways in, one result (`DistEnv`):
- nerfstudio's launcher (`ns-train odin --machine.num-devices N`) has already initialized torch.distributed;
- torchrun (`odin-train`, or `torchrun -m odin_ns.cli.worker`) leaves RANK/WORLD_SIZE/MASTER_ADDR in the
  environment, and the group is initialized here (gloo on CPU, NCCL on CUDA) with a bounded timeout;
- neither: one rank, no process group.
A rank also dies with its launcher (PR_SET_PDEATHSIG): torchrun does not stop its workers when it is killed itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from odin_ns.errors import OdinInputError

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    timeout_s: float = DEFAULT_TIMEOUT_S  # of every collective and point-to-point operation (--pipeline.dist-timeout-s)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the launcher) dies; no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def install_termination_message(rank: int) -> None:
    """On SIGTERM (torchrun tearing the job down after a failure elsewhere), say so in one line and exit.

    Python runs a signal's handler on the main thread between two bytecodes: a rank blocked inside the transport
    (a collective, a process group's set-up, the store) would run it only when that call returns, and torchrun
    kills a worker that has not exited 30 s after its SIGTERM: a job whose rank 0 stopped at a bad flag while rank
    1 set up its groups took 38 s to end. So the signal's number is also written, at once, to a pipe
    (`signal.set_wakeup_fd`) that a thread of the rank reads: whichever sees it first exits. Written here: Python
    has no handler that runs off the main thread."""
    message = (f"odin: rank {rank}: stopped by the launcher (another rank failed or the job was interrupted); see "
               "the launcher's message for the failed rank\n").encode()

    def _stop() -> None:
        os.write(2, message)  # no lock a blocked main thread could hold
        os._exit(143)

    def _on_term(signum, frame):  # noqa: ARG001 (signal handler signature)
        _stop()

    signal.signal(signal.SIGTERM, _on_term)  # the main thread's (Python refuses it elsewhere)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    # a child forked without exec (a worker pool) keeps the pipe: its own SIGTERM would stop this rank
    os.register_at_fork(after_in_child=_forget_wakeup_pipe)

    def _watch() -> None:
        while True:
            if signal.SIGTERM in os.read(read, 64):  # every signal with a Python handler writes its number
                _stop()

    threading.Thread(target=_watch, name="odin-sigterm", daemon=True).start()


def _forget_wakeup_pipe() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the child's main thread
        pass


# what gloo, NCCL and the c10d store say when a peer process or its machine is gone
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "remote process exited", "Socket Timeout", "DistNetworkError")
LOST_NOTICE = "lost the connection to the other ranks"


def lost_peer(exc: BaseException) -> str | None:
    """The transport's own first line when `exc` (or an exception it was raised from) says a peer is gone."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = f"{type(exc).__name__}: {exc}"
        if any(marker in text for marker in PEER_LOST):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return first.split("] ", 1)[-1][:200]  # without gloo's source location prefix
        exc = exc.__cause__ or exc.__context__
    return None


def say_lost_peer(rank: int, exc: BaseException) -> bool:
    """One line for a rank whose peers are gone (another rank or node stopped, the network failed), instead of a
    traceback from deep inside a receive; the launcher sums these lines up. False if `exc` is something else."""
    what = lost_peer(exc)
    if what is None:
        return False
    sys.stderr.write(f"odin: rank {rank}: {LOST_NOTICE} ({what})\n")
    sys.stderr.flush()
    return True


def init_distributed(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Join the existing process group, or start one from torchrun's environment, or run alone."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return DistEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)), str(dist.get_backend()), timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise OdinInputError(f"WORLD_SIZE={world} but {key} is not set: launch ranks with `odin-train --ranks "
                                 f"{world} ...` or torchrun")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise OdinInputError(f"local rank {local_rank} has no GPU of its own: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s) and NCCL needs one per rank (use --ranks "
                                 f"{torch.cuda.device_count()} or fewer, or CPU ranks: --machine.device-type cpu)")
        torch.cuda.set_device(local_rank)
    die_with_parent()
    install_termination_message(rank)
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank, world, local_rank, backend, timeout_s)
