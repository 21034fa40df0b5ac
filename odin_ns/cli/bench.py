"""`odin-bench`: measurements made side by side in one invocation (ratios, not absolute claims).

    odin-bench render                      # CPU rasterizer forward+backward at the reference sizes
    odin-bench train --ranks 2 --steps 200 # the same global batch: 1 rank (micro-batch N) vs N barrier ranks

`train` runs `odin-train` once per configuration, one after the other on the same scene, seeds and steps, and
prints views/s, the wait share by cause, per-rank Gaussians (owned and replicated) and the ideal: the busiest
rank's summed compute, which bounds what any synchronization scheme can reach. Extra arguments after `--` go
to every run (e.g. `-- odin-city --blocks-x 6`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table

QUIET_RUN = ["--vis", "tensorboard", "--steps-per-eval-image", "0", "--steps-per-eval-all-images", "0",
             "--steps-per-eval-batch", "0", "--steps-per-save", "1000000"]


def run_training(ranks: int, method: str, args: List[str], out: Path) -> Dict:
    cmd = [sys.executable, "-m", "odin_ns.cli.train", "--ranks", str(ranks), method, "--output-dir", str(out),
           *QUIET_RUN, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"odin-bench: the {ranks}-rank {method} run failed")
    stats = next(out.glob("**/odin_stats.json"))
    return json.loads(stats.read_text())["summary"]


def train_main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="odin-bench train", description="barrier training, 1 rank vs N ranks")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--method", default="odin-barrier")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: arguments for every run")
    args = ap.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    base = ["--max-num-iterations", str(args.steps)]
    # data-parser sub-commands must come last: put the run's own flags before the extra arguments
    configs = [("1 rank, micro-batch %d" % args.ranks, 1, base + ["--pipeline.micro-batch", str(args.ranks)]),
               (f"{args.ranks} ranks", args.ranks, base)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, ranks, flags in configs:
            summary = run_training(ranks, args.method, flags + extra, Path(tmp) / label.replace(" ", "_"))
            results.append((label, summary))
    table = Table(title=f"{args.method}: same global batch ({args.ranks} views/step), {args.steps} steps")
    for col in ("run", "views/s", "speed-up", "wait share", "barrier", "fetch", "transfer", "phase",
                "ideal speed-up", "owned/rank", "replicated/rank"):
        table.add_column(col, justify="right")
    base_rate = results[0][1]["views_per_s"]
    single_compute = results[0][1]["no_wait_bound_s"]
    for label, s in results:
        ideal = single_compute / s["no_wait_bound_s"] if s["no_wait_bound_s"] else float("nan")
        table.add_row(label, f"{s['views_per_s']:.2f}", f"{s['views_per_s'] / base_rate:.2f}x",
                      f"{s['wait_share_total']:.1%}", *(f"{s['wait_share'][c]:.1%}" for c in
                                                       ("barrier", "fetch", "transfer", "phase")),
                      f"{ideal:.2f}x", str(s["peak_gaussians_owned"]), str(s["peak_gaussians_replicated"]))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({label: s for label, s in results}, indent=2))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("render", "train"):
        print(__doc__)
        return 2
    if argv[0] == "render":
        from odin_ns.render.bench import main as render_main

        render_main(argv[1:])
        return 0
    return train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
