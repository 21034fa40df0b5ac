"""`odin-train`: launch N ranks of an odin method on this machine (or join a multi-node job) through torchrun.

    odin-train --ranks 2 odin-barrier --max-num-iterations 1000
    odin-train --ranks 4 --nnodes 2 --rdzv-endpoint host:29400 odin --data DIR     # the same on every node

Everything after the method name is an `ns-train` argument. torchrun's own flags given before the method
(`--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-backend`, `--rdzv-id`, `--master-addr`,
`--master-port`, `--max-restarts`, ...) are passed through. CPU ranks talk over gloo, CUDA ranks over NCCL.
When a rank fails, torchrun stops the others within seconds and this launcher names the failed rank; a user's
mistake (bad data, bad flags) ends in one `odin: error:` line however many ranks saw it (`launcher_output`).

Ctrl+C: the first asks every rank to stop at the next synchronization point (the end of the current phase, a few
steps); rank 0 writes a checkpoint and says where, and the launcher exits 130. A second Ctrl+C stops at once.
torchrun runs in a session of its own so that the terminal's Ctrl+C reaches the launcher alone (torchrun would
otherwise tear the ranks down before they can save), and dies with the launcher (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import List, Optional, Tuple

from odin_ns.cli.launcher_output import StderrFilter
from odin_ns.schedule.policies import POLICIES
from odin_ns.runtime.dist_env import die_with_parent
from odin_ns.runtime.stop_request import EXIT_INTERRUPTED, STOP_FILE_ENV

METHODS = tuple(p.method for p in POLICIES.values())
QUIET_WARNINGS = "ignore:`torch.cuda.amp.:FutureWarning"


def split_args(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(launcher arguments, [method, ns-train arguments...]) split at the first odin method name."""
    for i, arg in enumerate(argv):
        if arg in METHODS:
            return argv[:i], argv[i:]
    return argv, []


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors in the one-line form of every odin error (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"odin: error: {message} (odin-train --help)\n")


def error(message: str) -> int:
    print(f"odin: error: {message}", file=sys.stderr)
    return 2


def parse_launcher(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    parser = OneLineParser(
        prog="odin-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"odin-train [--ranks N] [torchrun flags] {{{','.join(METHODS)}}} [ns-train args]")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks (processes) on this machine; default: CUDA devices, or 2 on a CPU machine")
    known, passthrough = parser.parse_known_args(argv)
    return known, passthrough


def default_ranks() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return 2


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _flag_value(args: List[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_command(ranks: int, torchrun_args: List[str], training: List[str]) -> List[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    multi_node = any(a.startswith(("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr",
                                   "--master_addr")) for a in torchrun_args)
    if not multi_node and _flag_value(torchrun_args, "--master-port") is None:
        cmd.append("--standalone")  # a free port, chosen by torchrun
    rendezvous = any(a.startswith(("--rdzv-endpoint", "--rdzv_endpoint")) for a in torchrun_args)
    if rendezvous and not any(a.startswith(("--rdzv-backend", "--rdzv_backend")) for a in torchrun_args):
        # torchrun's default (static) rendezvous needs a distinct --node-rank on every node; c10d's gives every
        # node the same command, started at any time within the rendezvous timeout
        cmd.append("--rdzv-backend=c10d")
    cmd += torchrun_args
    cmd += ["-m", "odin_ns.cli.worker"] + training
    return cmd


def failed_ranks(log_tail: str) -> List[int]:
    """Every rank torchrun's error summary lists as failed."""
    return [int(r) for r in re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank:", log_tail)]


def failed_rank(log_tail: str) -> Optional[str]:
    """The rank torchrun reports as the root cause of the failure (its error summary's "Root Cause")."""
    root = log_tail.rfind("Root Cause")
    match = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", log_tail[root:] if root >= 0 else log_tail)
    return match.group(1) if match else None


def culprit(output: StderrFilter, log_tail: str) -> Optional[str]:
    """The rank that failed: one torchrun lists as failed that neither lost its connection to it nor was stopped by
    torchrun because of it (either may come first in torchrun's list, as the ranks end in a race), else torchrun's
    root cause."""
    victims = output.lost_ranks | output.torn_down_ranks
    culprits = [r for r in failed_ranks(log_tail) if r not in victims]
    return str(culprits[0]) if culprits else failed_rank(log_tail)


def peers_lost(output: StderrFilter, local_ranks: int, log_tail: str) -> bool:
    """Did this node's ranks fail only because their peers elsewhere went away? Every local rank said so, or every
    rank torchrun lists as failed here did (a rank killed here says nothing: it is the failure)."""
    if not output.lost_ranks:
        return False
    failed = failed_ranks(log_tail)
    if failed:
        return set(failed) <= output.lost_ranks
    return len(output.lost_ranks) >= local_ranks


class Interrupts:
    """The launcher's Ctrl+C: the first asks the ranks to stop (the stop file they look for at every phase end),
    the second kills torchrun, and the ranks with it."""

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.count = 0
        self.proc: Optional[subprocess.Popen] = None

    def __call__(self, signum, frame):  # noqa: ARG002 (signal handler signature)
        self.count += 1
        if self.count == 1:
            self.stop_file.touch()
            print("odin: Ctrl+C: every rank stops at the end of its current phase and rank 0 writes a checkpoint "
                  "(Ctrl+C again stops at once, without one)", file=sys.stderr, flush=True)
        elif self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # the ranks get SIGTERM from their parent's death and exit at once

    def forward_term(self, signum, frame):  # noqa: ARG002
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # torchrun stops its ranks on SIGTERM


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    launcher_args, training = split_args(argv)
    known, torchrun_args = parse_launcher(launcher_args)
    if not training:
        return error(f"name a method ({', '.join(METHODS)}) followed by ns-train arguments")
    ranks = known.ranks if known.ranks is not None else default_ranks()
    if ranks < 1:
        return error(f"--ranks must be at least 1 (got {ranks})")
    port = _flag_value(torchrun_args, "--master-port")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        return error(f"--master-port must be a port number (got {port!r})")
    if port is not None and not port_free(int(port)):
        return error(f"port {port} is in use (choose another --master-port, or leave it out to get a free one)")
    env = dict(os.environ)
    env.setdefault("ODIN_TIMESTAMP", datetime.now().strftime("%Y-%m-%d_%H%M%S"))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    # nerfstudio's deprecated torch.cuda.amp calls warn on import, twice per rank: noise in front of every message
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), QUIET_WARNINGS]))
    # splatfacto wraps a function in torch.compile as it is imported, which imports torch's inductor: about 1 s of
    # every rank's start-up on a 2-core machine, for a function odin does not call (`render.viewmat`); odin compiles
    # nothing (TORCHDYNAMO_DISABLE=0 in the environment keeps torch.compile on)
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    stop_file = Path(tempfile.gettempdir()) / f"odin-stop-{os.getpid()}"
    stop_file.unlink(missing_ok=True)
    env[STOP_FILE_ENV] = str(stop_file)
    interrupts = Interrupts(stop_file)
    cmd = build_command(ranks, torchrun_args, training)
    previous = (signal.signal(signal.SIGINT, interrupts), signal.signal(signal.SIGTERM, interrupts.forward_term))
    try:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=die_with_parent)
        interrupts.proc = proc
        output = StderrFilter(sys.stderr)
        assert proc.stderr is not None
        tail: List[str] = []
        for line in proc.stderr:
            output.feed(line)
            tail.append(line)
            del tail[:-200]
        code = proc.wait()
        output.peers_lost = code != 0 and peers_lost(output, ranks, "".join(tail))
        output.finish()
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        stop_file.unlink(missing_ok=True)
    if output.stopped:
        return EXIT_INTERRUPTED
    if interrupts.count > 1:
        print("odin: error: stopped at once by a second Ctrl+C; the last complete checkpoint, if any, is in the "
              "run's nerfstudio_models/ folder", file=sys.stderr)
        return EXIT_INTERRUPTED
    if output.errors:
        return 1
    if output.peers_lost:
        print(f"odin: error: the ranks on this node ({', '.join(map(str, sorted(output.lost_ranks)))}) lost their "
              "connection to the rest of the job: another node's launcher or ranks stopped, or the network failed "
              "(that node's launcher says which); every rank here has been stopped. The last complete checkpoint, if "
              "any, is in the run's nerfstudio_models/ folder on the node that holds rank 0.", file=sys.stderr)
        return code
    if code != 0:
        rank = culprit(output, "".join(tail))
        who = f"rank {rank} failed" if rank is not None else "a rank failed"
        print(f"odin: error: {who} (exit {code}); every rank has been stopped. The last complete "
              "checkpoint, if any, is in the run's nerfstudio_models/ folder.", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
