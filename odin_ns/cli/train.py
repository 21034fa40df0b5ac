"""`odin-train`: launch N ranks of an odin method on this machine (or join a multi-node job) through torchrun.

    odin-train --ranks 2 odin-barrier --max-num-iterations 1000
    odin-train --ranks 8 --nnodes 2 --node-rank 0 --rdzv-endpoint host:29400 odin --data DIR

Everything after the method name is an `ns-train` argument. torchrun's own flags given before the method
(`--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-backend`, `--rdzv-id`, `--master-addr`,
`--master-port`, `--max-restarts`, ...) are passed through. CPU ranks talk over gloo, CUDA ranks over NCCL.
When a rank fails, torchrun stops the others within seconds and this launcher names the failed rank.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from datetime import datetime
from typing import List, Optional, Tuple

METHODS = ("odin", "odin-throughput", "odin-barrier")


def split_args(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(launcher arguments, [method, ns-train arguments...]) split at the first odin method name."""
    for i, arg in enumerate(argv):
        if arg in METHODS:
            return argv[:i], argv[i:]
    return argv, []


def parse_launcher(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    parser = argparse.ArgumentParser(
        prog="odin-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="odin-train [--ranks N] [torchrun flags] {odin,odin-throughput,odin-barrier} [ns-train args]")
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
    cmd += torchrun_args
    cmd += ["-m", "odin_ns.cli.worker"] + training
    return cmd


def failed_rank(log_tail: str) -> Optional[str]:
    """The rank torchrun reports as the root cause of the failure (its error summary's "Root Cause")."""
    root = log_tail.rfind("Root Cause")
    match = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", log_tail[root:] if root >= 0 else log_tail)
    return match.group(1) if match else None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    launcher_args, training = split_args(argv)
    known, torchrun_args = parse_launcher(launcher_args)
    if not training:
        print(f"odin-train: error: name a method ({', '.join(METHODS)}) followed by ns-train arguments",
              file=sys.stderr)
        return 2
    ranks = known.ranks if known.ranks is not None else default_ranks()
    if ranks < 1:
        print(f"odin-train: error: --ranks must be at least 1 (got {ranks})", file=sys.stderr)
        return 2
    port = _flag_value(torchrun_args, "--master-port")
    if port is not None and not port_free(int(port)):
        print(f"odin-train: error: port {port} is in use (choose another --master-port, or leave it out to get a "
              "free one)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("ODIN_TIMESTAMP", datetime.now().strftime("%Y-%m-%d_%H%M%S"))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    cmd = build_command(ranks, torchrun_args, training)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    tail: List[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        tail.append(line)
        del tail[:-200]
    code = proc.wait()
    if code != 0:
        rank = failed_rank("".join(tail))
        who = f"rank {rank} failed" if rank is not None else "a rank failed"
        print(f"odin-train: error: {who} (exit {code}); every rank has been stopped. The last complete "
              "checkpoint, if any, is in the run's nerfstudio_models/ folder.", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
