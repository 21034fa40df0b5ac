"""One rank of a distributed odin training: `python -m odin_ns.cli.worker METHOD [ns-train arguments]`.

torchrun starts one of these per rank (`odin-train` does it for you). It parses the same arguments as
`ns-train`, joins the process group from torchrun's environment, checks that every rank got the same
configuration, and runs nerfstudio's training loop with the odin trainer. Only rank 0 writes outputs.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import List, Optional

import torch.distributed as dist
from nerfstudio.utils.rich_utils import CONSOLE
from rich.markup import escape

from odin_ns.cli.config_union import parse_odin_config

from odin_ns.errors import OdinInputError
from odin_ns.runtime.config_check import check_same_config
from odin_ns.runtime.dist_env import init_distributed, say_lost_peer
from odin_ns.trainer import OdinTrainerConfig, check_device


def parse(args: List[str], first_rank: bool):
    """ns-train's parsing; tyro's usage message is printed once (by rank 0), then one `odin: error:` line that the
    launcher recognises as the user's mistake (and so keeps torchrun's failure report to itself)."""
    try:
        if first_rank:
            return parse_odin_config(args, "odin-train")
        with contextlib.redirect_stderr(io.StringIO()):
            return parse_odin_config(args, "odin-train")
    except SystemExit as exc:
        if exc.code not in (0, None) and not isinstance(exc, OdinInputError):
            raise SystemExit("odin: error: the arguments above are not valid (odin-train METHOD --help lists them)")
        raise


def shared_timestamp(mine: str) -> str:
    """Rank 0's run timestamp, for every rank: one output folder, however far apart the launchers on several nodes
    started (each launcher stamps its own start time, and the configurations the ranks compare include it)."""
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = parse(args, first_rank=int(os.environ.get("RANK", "0")) == 0)
    if not isinstance(config, OdinTrainerConfig):
        raise OdinInputError(f"method {config.method_name!r} is not an odin method: use odin, odin-throughput "
                             "or odin-barrier (other nerfstudio methods train with ns-train)")
    if config.data:
        config.pipeline.datamanager.data = config.data
    timestamp = os.environ.get("ODIN_TIMESTAMP")
    if timestamp:
        config.timestamp = timestamp
    check_device(config.machine.device_type)
    env = init_distributed(config.machine.device_type, config.pipeline.dist_timeout_s)
    config.set_timestamp()
    warning = None
    if env.distributed:
        config.timestamp = shared_timestamp(config.timestamp)
        warning = check_same_config(config, env.rank, env.world_size, cpu=config.machine.device_type == "cpu")
    if env.rank != 0:
        CONSOLE.quiet = True  # rank 0 speaks for the job; errors still reach stderr
    else:
        config.print_to_terminal()
        config.save_config()
        CONSOLE.log(f"odin: {env.world_size} rank(s), backend {env.backend}")
        if warning:  # after the configuration's dump, where it is read
            CONSOLE.print(f"[yellow]odin: warning: {escape(warning)}[/yellow]", soft_wrap=True)
    try:
        trainer = config.setup(local_rank=env.local_rank, world_size=env.world_size)
        trainer.setup()
        trainer.train()
    except (Exception, SystemExit) as exc:
        if not env.distributed or (isinstance(exc, SystemExit) and isinstance(exc.code, (int, type(None)))):
            raise  # alone, or an exit with a code (a stop the ranks agreed on: its collective parts are done)
        if isinstance(exc, SystemExit):  # an `odin: error:` line, printed as the interpreter would
            sys.stderr.write(f"{exc.code}\n")
        elif not say_lost_peer(env.rank, exc):
            sys.excepthook(type(exc), exc, exc.__traceback__)  # what the interpreter would print (torch's hook
            # marks each line with the rank)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a launcher gone (broken pipe): the exit below matters more
                pass
        # no teardown and no interpreter finalization: collectives with lost peers would block the one, and the
        # other aborts the process (SIGABRT, "terminate called without an active exception") where a thread is
        # still inside the transport's wait for a send (`runtime.send_reaper`) as its peer exits too: every rank
        # failing at once did that in 3 of 6 runs. Handlers registered with atexit (a logger's upload) do not run,
        # as on the lost-peer path
        os._exit(1)
    if env.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
