"""`odin-schedule`: print the view schedule of a run (which rank renders which view at which step) as CSV.

    odin-schedule --views 42 --ranks 4 --steps 10 [--micro-batch 1] [--seed 42]

The seed is nerfstudio's `--pipeline.datamanager.train-cameras-sampling-seed`; the views are indices into the
training split, as the data parser lists them.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from odin_ns.schedule.views import ViewSchedule


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="odin-schedule", description=__doc__.split("\n")[0])
    ap.add_argument("--views", type=int, required=True, help="number of training views")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--first-step", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        schedule = ViewSchedule(args.views, args.ranks, args.micro_batch, args.seed)
    except ValueError as exc:
        ap.error(str(exc))
    sys.stdout.write(schedule.to_csv(args.first_step, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
