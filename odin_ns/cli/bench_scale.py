"""`odin-bench scale`: the runtime's own cost per step as the scene grows, against the floor of a plain Adam step.

    odin-bench scale [--sizes 4000,40000,200000] [--block-sizes 512,64] [--steps 40] [--count-steps 4]
                     [--policies odin-barrier,odin] [--ranks 2] [--device cpu] [--json FILE] [-- NS-TRAIN ARGS]
    odin-bench scale --ranks 1 --device cuda --sizes 1000000 --block-sizes 4096 --policies odin   # make gpu-check

For each number of Gaussians and block size, real ranks (2, `--ranks`) train the built-in city at a small resolution
(64x48, densification off, so the count stays; SH degree 3 from step 3, so that every one of a row's 59 columns
trains, as the floor's do: below degree 3 the update skips the coefficients that do not train) under each policy,
one after the other in this invocation. From each run's odin_stats.json, per step and rank: render, update,
bookkeeping, loop, planning and wait in ms (mean over the steps at degree 3 before the counted ones, from the one
after the phase start the change to degree 3 makes: later phase starts included); the tensor operations the
runtime's side of a step (validate and publish: all but the render) dispatches and the host syncs among them,
counted on the last `--count-steps` steps (`runtime.op_count`: what a GPU pays per kernel launch and per stall,
machine-independent); peak resident Gaussians per rank (its owned rows) as a share of the model, and its peak bytes
(owned rows with Adam's moments and the most its message buffers held at once) as a share of one process's rows with
moments. The floor: an Adam step over a rank's owned rows written as three in-place operations on one packed [rows,
59] tensor (the moments' two, the parameters' one), on one thread (as each of 2 ranks on 2 cores gets) or the GPU,
timed in this same invocation; `torch.optim.Adam` over the six parameters is timed beside it. `--device cuda` trains
the ranks on the GPU and times both floors there (one rank: NCCL takes a GPU per rank). The targets of the runtime
at scale (its own work: update + bookkeeping + loop + planning, every step, at most 3x the floor; operations and
syncs flat in the block count, syncs at most 2) are printed beside the figures. An owner's projections for its
readers and their backward count as render.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table

COLUMNS = 59  # packed parameter columns at SH degree 3 (3 + 3 + 4 + 3 + 45 + 1)
TARGET_FLOOR_RATIO = 3.0


def city_args(size: int, block_size: int) -> List[str]:
    return ["--pipeline.model.stop-split-at", "0", "--pipeline.model.sh-degree-interval", "1",
            "--pipeline.block-size", str(block_size),
            "odin-city", "--width", "64", "--height", "48", "--num-points", str(size)]


def _timed_ms(step, repeats: int, device: str) -> float:
    """Median ms of `step()` over `repeats` calls after one more, on one CPU thread or synchronized on CUDA."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        step()
        times = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def adam_floor_ms(rows: int, repeats: int = 15, device: str = "cpu") -> float:
    """Median ms of one `torch.optim.Adam` step over `rows` Gaussians (the six parameters, 59 columns), one thread
    (on CUDA its default, the multi-tensor kernels)."""
    import torch

    widths = (3, 3, 4, 3, 45, 1)
    params = [torch.nn.Parameter(torch.randn(rows, w, device=device)) for w in widths]
    opt = torch.optim.Adam(params, lr=1e-3, eps=1e-15)
    for p in params:
        p.grad = torch.randn_like(p)
    return _timed_ms(opt.step, repeats, device)


def inplace_adam_floor_ms(rows: int, repeats: int = 15, device: str = "cpu") -> float:
    """Median ms of an Adam step over `rows` packed Gaussians (59 columns) written as three in-place operations,
    one thread (or the GPU): what an update of a rank's owned rows cannot go below."""
    import torch

    param, grad = torch.randn(rows, COLUMNS, device=device), torch.randn(rows, COLUMNS, device=device)
    m, v = torch.zeros_like(param), torch.ones_like(param)

    def step():
        m.lerp_(grad, 0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        param.addcdiv_(m, v.sqrt().add_(1e-15), value=-1e-3)
    return _timed_ms(step, repeats, device)


FULL_DEGREE_FROM = 4  # SH degree 3 from step 3 (`city_args`: a degree a step), whose change starts a phase: the
# steps after that start-up, as the run's first step is left out


def per_step(stats: Dict, count_from: int) -> Dict:
    """Means per step and rank over every step at SH degree 3 before the counted ones but the phase start at that
    degree (the bench's start-up, as a run's first step is), later phase starts included, and the counts."""
    records = stats["steps"]
    first = min(r["step"] for r in records)
    timed = [r for r in records if max(first + 1, FULL_DEGREE_FROM) <= r["step"] < count_from]
    counted = [r for r in records if r.get("runtime_ops") is not None]

    def ms(key):
        return 1000 * statistics.mean(r[key] for r in timed) if timed else float("nan")

    out = {k: ms(f) for k, f in (("render", "compute_s"), ("update", "update_s"), ("bookkeeping", "bookkeeping_s"),
                                 ("loop", "loop_s"), ("plan", "plan_s"), ("wall", "wall_s"))}
    out["wait"] = 1000 * statistics.mean(sum(r["wait_s"].values()) for r in timed) if timed else float("nan")
    out["ops"] = statistics.mean(r["runtime_ops"] for r in counted) if counted else None
    out["syncs"] = statistics.mean(r["runtime_syncs"] for r in counted) if counted else None
    summary = stats["summary"]
    owned = summary["peak_gaussians_owned"]
    last = max(r["step"] for r in records)
    total = sum(r["gaussians_owned"] for r in records if r["step"] == last)  # densification is off: constant
    out["gaussians"] = total
    out["owned_mean"] = statistics.mean(owned)
    out["resident_share"] = summary["peak_resident_share"]
    out["bytes_share"] = summary["peak_bytes_share"]
    out["blocks"] = round(summary["mean_blocks_total"])
    out["timed_steps"] = len({r["step"] for r in timed})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    from odin_ns.cli.bench import run_training

    ap = argparse.ArgumentParser(prog="odin-bench scale", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4000,40000,200000", help="Gaussians (seed points of the city), comma list")
    ap.add_argument("--block-sizes", default="512,64", help="--pipeline.block-size values, comma list")
    ap.add_argument("--policies", default="odin-barrier,odin", help="methods, comma list")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    ap.add_argument("--count-steps", type=int, default=4, help="last steps whose operations are counted")
    ap.add_argument("--ranks", type=int, default=2, help="ranks per run (default 2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="train on the CPU or on CUDA (then the floors are timed on the GPU too)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("extra", nargs=argparse.REMAINDER,
                    help="after --: ns-train arguments for every run (e.g. --pipeline.view-order random)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    policies = args.policies.split(",")
    if args.count_steps < 1 or args.steps <= args.count_steps + 5:
        raise SystemExit("odin: error: --steps must exceed --count-steps by more than 5 (timed steps come first)")
    if args.ranks < 1:
        raise SystemExit("odin: error: --ranks must be at least 1")
    count_from = args.steps - args.count_steps
    env = {"ODIN_NS_COUNT_OPS": f"{count_from}:{args.steps - 1}"}
    device_args = ["--machine.device-type", args.device]  # the methods take a GPU where there is one otherwise
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            for block_size in block_sizes:
                for method in policies:
                    print(f"odin-bench scale: {method}, {size} Gaussians, block size {block_size}, {args.ranks} "
                          f"rank(s), {args.steps} steps, {args.device}", flush=True)
                    out = Path(tmp) / f"{method}-{size}-{block_size}"
                    # --steps counts steps (the recipe would count views: a step of 2 ranks trains 2)
                    run = run_training(args.ranks, method, ["--max-num-iterations", str(args.steps),
                                                            "--pipeline.recipe", "steps", "--pipeline.view-order",
                                                            "odin"] + device_args
                                       + [a for a in args.extra if a != "--"] + city_args(size, block_size),
                                       out, method, "odin", env=env)
                    stats = {"summary": run["summary"], "steps": run["records"]}
                    rows.append({"method": method, "size": size, "block_size": block_size,
                                 **per_step(stats, count_from)})
    owned = {size: int(statistics.mean(r["owned_mean"] for r in rows if r["size"] == size)) for size in sizes}
    floors = {size: inplace_adam_floor_ms(n, device=args.device) for size, n in owned.items()}
    optim = {size: adam_floor_ms(n, device=args.device) for size, n in owned.items()}
    for r in rows:
        r["adam_floor_ms"] = floors[r["size"]]
        r["torch_adam_ms"] = optim[r["size"]]
        r["runtime_ms"] = r["update"] + r["bookkeeping"] + r["loop"] + r["plan"]
        r["floor_ratio"] = r["runtime_ms"] / r["adam_floor_ms"] if r["adam_floor_ms"] else float("nan")
        r["non_render_share"] = (r["wall"] - r["render"]) / r["wall"] if r["wall"] else float("nan")
    print_table(rows, args.ranks, args.device)
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "count_steps": args.count_steps, "rows": rows},
                                        indent=2))
    return 0


def print_table(rows: List[Dict], ranks: int = 2, device: str = "cpu") -> None:
    table = Table(title=f"the runtime at scale: {ranks} rank(s) on {device}, ms per step and rank (mean of every "
                        "step but the first)")
    for col in ("method", "Gaussians", "blocks", "render", "update", "bookkeeping", "loop", "plan", "wait",
                "own work / Adam floor (torch.optim.Adam)", "ops/step", "syncs/step", "resident per rank",
                "wall - render"):
        table.add_column(col, justify="right")
    for r in rows:
        resident = ", ".join(f"{s:.0%}" for s in r["resident_share"]) + " / " + \
            ", ".join(f"{s:.0%}" for s in r["bytes_share"])
        table.add_row(r["method"], f"{r['gaussians']}", f"{r['blocks']} ({r['block_size']})",
                      *(f"{r[k]:.1f}" for k in ("render", "update", "bookkeeping", "loop", "plan", "wait")),
                      f"{r['runtime_ms']:.1f} / {r['adam_floor_ms']:.2f} = {r['floor_ratio']:.1f}x "
                      f"({r['torch_adam_ms']:.2f})",
                      "-" if r["ops"] is None else f"{r['ops']:.0f}",
                      "-" if r["syncs"] is None else f"{r['syncs']:.0f}", resident,
                      f"{r['non_render_share']:.0%}")
    Console(width=220).print(table)
    print(f"Targets: the runtime's own work (update + bookkeeping + loop + planning, every step) <= "
          f"{TARGET_FLOOR_RATIO}x the Adam floor (an Adam step over a rank's owned rows as three in-place "
          "operations, one thread or the GPU, timed in this invocation; torch.optim.Adam in brackets); operations "
          "per step flat in the block count, host syncs at most 2; wall - render <= 25% at 200k Gaussians; resident "
          "per rank: its owned rows, as a share of the model / its peak bytes (owned rows with Adam's moments and "
          "the most its message buffers held at once) as a share of one process's rows with moments.")


if __name__ == "__main__":
    sys.exit(main())
