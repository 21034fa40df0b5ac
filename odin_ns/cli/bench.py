"""`odin-bench`: measurements made side by side in one invocation (ratios, not absolute claims).

    odin-bench render                                        # CPU rasterizer forward+backward
    odin-bench scale [--sizes 4000,40000,200000] [--block-sizes 512,64] [--json FILE]   # the runtime's cost
    odin-bench predict [--ranks 8,16] [--scenes ...] [--link pcie|nvlink|infiniband|loopback]   # a GPU cluster
    odin-bench scaling --ranks 2 --scene city|fox [--views 1500] [--seeds 42,7,11] [--json FILE]   # time to quality
    odin-bench train --ranks 2 --scene city|city-aerial|fox [--steps K] [--repeat N] [--json FILE] [--out DIR]
                     [--keep-runs] [--thread-lane]

`train` runs, one after the other in one invocation, on the same data, seeds and steps: `odin-barrier` on
nerfstudio's random order, then `odin-barrier`, `odin` and `odin-throughput` on Odin's schedule (and, with
`--thread-lane`, `odin-throughput` with its communication lane on a thread). It prints one
table (views/s, speed-up over barrier on the same schedule, the ideal speed-up, wait hidden, raw and at equal
compute speed or processor time, the time breakdown per rank, bytes per step, block reads admitted behind and
refused, held-out PSNR from `ns-eval`), writes a per-rank timeline and bars of speed-up and wait hidden as PNG,
and with `--json` the rows. `--repeat N` makes N rounds of the runs, every other one in reverse order, and reports for each run its round with the median wall (shared machines drift over minutes). Extra
arguments after `--` go to every run before the scene's data parser (e.g. `-- --pipeline.block-size 256`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table

from odin_ns.cli import bench_figures
from odin_ns.schedule.policies import POLICIES

QUIET_RUN = ["--vis", "tensorboard", "--steps-per-eval-image", "0", "--steps-per-eval-all-images", "0",
             "--steps-per-eval-batch", "0", "--steps-per-save", "1000000"]


SCENES = {
    "city": ["odin-city"],
    "city-aerial": ["--pipeline.block-size", "256", "odin-city", "--blocks-x", "6", "--blocks-y", "6",
                    "--num-street-cameras", "0", "--num-aerial-cameras", "0", "--num-survey-cameras", "100",
                    "--num-points", "8000"],
    "fox": ["--pipeline.datamanager.camera-res-scale-factor", "0.125", "--pipeline.model.random-init", "True",
            "--pipeline.model.num-random", "10000", "--pipeline.model.random-scale", "2.0", "instant-ngp-data"],
}
# (label, method, view order): barrier on nerfstudio's order (what a user would otherwise run), then every policy
# on Odin's schedule
BASELINE = next(p for p in POLICIES.values() if p.barrier)
RUNS = [(f"{BASELINE.label}, random order", BASELINE.method, "random")] + [
    (p.label, p.method, "odin") for p in sorted(POLICIES.values(), key=lambda p: not p.barrier)]
POLICY = {p.method: p.name for p in POLICIES.values()}
DEFAULT_FOX = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "fox"


def run_training(ranks: int, method: str, args: List[str], out: Path, label: str, schedule: str,
                 env: Optional[Dict[str, str]] = None) -> Dict:
    """One `odin-train` run; its odin_stats.json (summary and per-step records), its config path, and what
    `compare` and the pictures need to know of it (label, method, policy, schedule: the view order, ranks)."""
    cmd = [sys.executable, "-m", "odin_ns.cli.train", "--ranks", str(ranks), method, "--output-dir", str(out),
           *QUIET_RUN, *args]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    process_wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"odin-bench: the {ranks}-rank {method} run failed")
    stats_path = next(out.glob("**/odin_stats.json"))
    stats = json.loads(stats_path.read_text())
    return {"summary": stats["summary"], "records": stats["steps"], "config": stats_path.parent / "config.yml",
            "label": label, "method": method, "policy": POLICY[method], "schedule": schedule, "ranks": ranks,
            "process_wall_s": process_wall}


def held_out_metrics(config: Path) -> Optional[Dict[str, float]]:
    """nerfstudio's own `ns-eval` on the run's final checkpoint: its averages over every held-out view (psnr, ssim,
    lpips where its weights are on disk, ...)."""
    out = config.parent / "eval.json"
    proc = subprocess.run([str(Path(sys.executable).with_name("ns-eval")), "--load-config", str(config),
                           "--output-path", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-2000:])
        return None
    return {k: float(v) for k, v in json.loads(out.read_text())["results"].items()}


def held_out_psnr(config: Path) -> Optional[float]:
    metrics = held_out_metrics(config)
    return None if metrics is None else metrics["psnr"]


def scene_args(scene: str, data: Optional[Path]) -> List[str]:
    if scene not in SCENES:
        raise SystemExit(f"odin: error: unknown scene {scene!r} (choose from {', '.join(SCENES)})")
    if scene == "fox":
        folder = data or DEFAULT_FOX
        if not (folder / "transforms.json").exists():
            raise SystemExit(f"odin: error: no instant-ngp transforms.json under {folder} (give --data)")
        return ["--data", str(folder)] + SCENES[scene]
    return list(SCENES[scene])


def median_run(tries: List[Dict]) -> Dict:
    """The round of a run with the median training wall (the lower middle one of an even count); it carries the
    first round's PSNR and every round's wall."""
    ordered = sorted(tries, key=lambda r: r["summary"]["train_wall_s"])
    run = dict(ordered[(len(ordered) - 1) // 2])
    run["psnr"] = tries[0]["psnr"]
    run["round_walls_s"] = [r["summary"]["train_wall_s"] for r in tries]
    return run


def pooled_run(tries: List[Dict]) -> Dict:
    """Rounds of one run taken together, as one longer run: walls, times and views summed over the rounds (so
    rounds run in alternating order cancel a machine that speeds up or slows down over the invocation)."""
    run = dict(tries[0])
    summary = dict(run["summary"])
    for key in ("train_wall_s", "no_wait_bound_s", "views"):
        summary[key] = sum(t["summary"][key] for t in tries)
    summary["views_per_s"] = summary["views"] / summary["train_wall_s"] if summary["train_wall_s"] else None
    per_rank = []
    for q, first in enumerate(summary["per_rank"]):
        ranks = [t["summary"]["per_rank"][q] for t in tries]
        per_rank.append({k: ({c: sum(p[k][c] for p in ranks) for c in v} if isinstance(v, dict) else
                             sum(p.get(k, 0.0) for p in ranks)) for k, v in first.items()})
    summary["per_rank"] = per_rank
    summary["wait_s"] = {c: sum(t["summary"]["wait_s"][c] for t in tries) for c in summary["wait_s"]}
    summary["bytes_per_step"] = sum(t["summary"]["bytes_per_step"] for t in tries) / len(tries)
    for key in ("stale_admitted", "stale_refused"):
        summary[key] = sum(t["summary"].get(key, 0) for t in tries)
    run["summary"] = summary
    run["round_walls_s"] = [t["summary"]["train_wall_s"] for t in tries]
    return run


def _work(summary: Dict) -> float:
    """Mean over ranks of the seconds a rank's own thread computed (everything but its waits)."""
    ranks = summary["per_rank"]
    return sum(p["render_s"] + p["update_s"] + p["bookkeeping_s"] + p["loop_s"] for p in ranks) / len(ranks)


def _cpu(summary: Dict) -> float:
    """Mean over ranks of the processor seconds a rank's process used (every thread: a lane on a thread too)."""
    ranks = summary["per_rank"]
    return sum(p.get("cpu_s", 0.0) for p in ranks) / len(ranks)


def compare(runs: List[Dict]) -> List[Dict]:
    """DESIGN.md "Measuring": ideal = busiest rank's render + update in the barrier run on Odin's schedule;
    wait = wall - ideal; hidden = 1 - wait / wait(barrier); speed-ups over that barrier run."""
    barrier = next(r for r in runs if r["policy"] == BASELINE.name and r["schedule"] == "odin")
    ideal = barrier["summary"]["no_wait_bound_s"]
    barrier_wait = barrier["summary"]["train_wall_s"] - ideal
    rows = []
    for r in runs:
        s = r["summary"]
        wall = s["train_wall_s"]
        # the same work computes at different speeds from run to run on a shared machine: scaled to the barrier
        # run's speed (the rank's own work, render + update + bookkeeping + loop, wall minus waits, against
        # this run's), a run's wall and wait are what they would have been on the barrier run's machine.
        # Measured on the rank's own thread, so that throughput-first's update thread, which shares the cores
        # here, counts as the render time it takes, not as a faster machine (defined for runs of the same work
        # only: the same schedule)
        same_work = r["schedule"] == barrier["schedule"] and _work(s) > 0
        scale = _work(barrier["summary"]) / _work(s) if same_work else float("nan")
        # the same, scaled by the processor time of the ranks' processes instead: every thread's work counts once
        # (a lane on a thread included, the waiting not), whichever thread did it
        cpu_scale = _cpu(barrier["summary"]) / _cpu(s) if same_work and _cpu(s) > 0 else float("nan")
        parts = {k: sum(p[k] for p in s["per_rank"]) / s["ranks"] for k in
                 ("render_s", "update_s", "bookkeeping_s", "loop_s")}
        waits = {c: sum(p["wait_s"][c] for p in s["per_rank"]) / s["ranks"] for c in s["wait_s"]}
        rows.append({
            "label": r["label"], "policy": r["policy"], "schedule": r["schedule"], "method": r["method"],
            "views_per_s": s["views_per_s"], "wall_s": wall, "ideal_s": ideal,
            "speedup": barrier["summary"]["train_wall_s"] / wall if wall else float("nan"),
            "ideal_speedup": barrier["summary"]["train_wall_s"] / ideal if ideal else float("nan"),
            "wait_s": wall - ideal,
            "wait_hidden": 1 - (wall - ideal) / barrier_wait if barrier_wait > 0 else float("nan"),
            "busy_s": s["no_wait_bound_s"],
            "speedup_equal_speed": barrier["summary"]["train_wall_s"] / (wall * scale) if wall else float("nan"),
            "wait_hidden_equal_speed": (1 - (wall * scale - ideal) / barrier_wait
                                        if barrier_wait > 0 else float("nan")),
            "speedup_equal_cpu": barrier["summary"]["train_wall_s"] / (wall * cpu_scale) if wall else float("nan"),
            "wait_hidden_equal_cpu": (1 - (wall * cpu_scale - ideal) / barrier_wait
                                      if barrier_wait > 0 else float("nan")),
            "cpu_s": _cpu(s),
            "per_rank_mean_s": {**parts, **{f"wait_{c}_s": w for c, w in waits.items()}},
            "bytes_per_step": s["bytes_per_step"], "psnr": r.get("psnr"),
            "round_walls_s": r.get("round_walls_s", [wall]),
            "read_set_misses": s["read_set_misses"], "misses_handled": s["misses_handled"],
            "mean_blocks_read": s["mean_blocks_read"], "mean_blocks_total": s["mean_blocks_total"],
            "peak_resident_share": s.get("peak_resident_share", []),
            "peak_bytes_per_rank": s.get("peak_bytes_per_rank", []),
            "peak_bytes_share": s.get("peak_bytes_share", []),
            "peak_projection_bytes": s.get("peak_projection_bytes_per_rank", []),
            "bytes_per_pair": (s.get("bytes_per_pair_to_reader"), s.get("bytes_per_pair_back")),
            "stale_admitted": s.get("stale_admitted", 0), "stale_refused": s.get("stale_refused", 0),
            "max_staleness_seen": s.get("max_staleness_seen", 0),
            "replayed_wall_s": r.get("replayed_wall_s"),
        })
    return rows


def replayed_wall(run: Dict, flags: List[str]) -> Optional[float]:
    """The run's wall as the replay predicts it: its own plan (made again from the same flags, without training)
    and its own lists, with the costs it measured (`odin-schedule --costs`: per step where the views match, and
    this machine's loopback latency per message). What `odin-bench predict` does with a GPU's costs."""
    from odin_ns.cli.schedule import _method_config, replay_costs
    from odin_ns.schedule.preview import build_preview
    from odin_ns.schedule.simulate import simulate

    config = _method_config([run["method"], *QUIET_RUN, *flags])
    preview = build_preview(config, run["ranks"])  # the whole run, in its recipe's steps
    costs, _ = replay_costs(config, preview, run["config"].parent / "odin_stats.json")
    return simulate(preview.policy_plans()[run["method"]], costs).wall_s


def print_table(rows: List[Dict], title: str) -> None:
    table = Table(title=title)
    cols = ("run", "views/s", "speed-up", "ideal", "wait hidden", "at equal speed", "at equal CPU", "render",
            "update", "bookkeeping", "loop",
            "validate", "transfer", "barrier", "phase", "MB/step", "B/pair", "resident", "stale/refused",
            "replayed wall",
            "PSNR")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        p = r["per_rank_mean_s"]
        table.add_row(r["label"], f"{r['views_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['ideal_speedup']:.2f}x",
                      f"{r['wait_hidden']:.0%}", "-" if math.isnan(r["speedup_equal_speed"]) else
                      f"{r['speedup_equal_speed']:.2f}x, {r['wait_hidden_equal_speed']:.0%}",
                      "-" if math.isnan(r["speedup_equal_cpu"]) else
                      f"{r['speedup_equal_cpu']:.2f}x, {r['wait_hidden_equal_cpu']:.0%}",
                      *(f"{p[k]:.2f}" for k in ("render_s", "update_s", "bookkeeping_s", "loop_s", "wait_validate_s",
                                                "wait_transfer_s", "wait_barrier_s", "wait_phase_s")),
                      f"{r['bytes_per_step'] / 1e6:.2f}",
                      "-" if r["bytes_per_pair"][0] is None else "/".join(f"{x:.0f}" for x in r["bytes_per_pair"]),
                      "/".join(f"{x:.0%}" for x in r["peak_resident_share"]) + " " +
                      "/".join(f"{x / 1e6:.1f}" for x in r["peak_bytes_per_rank"]) + " MB = " +
                      "/".join(f"{x:.0%}" for x in r["peak_bytes_share"]) + " (+" +
                      "/".join(f"{x / 1e6:.1f}" for x in r["peak_projection_bytes"]) + ")",
                      f"{r['stale_admitted']}/{r['stale_refused']}" if POLICIES[r["policy"]].stale_reads else "-",
                      "-" if not r.get("replayed_wall_s") else
                      f"{r['replayed_wall_s']:.1f} ({r['replayed_wall_s'] / r['wall_s'] - 1:+.0%})",
                      "-" if r["psnr"] is None else f"{r['psnr']:.2f}")
    Console(width=200).print(table)
    print("Times are seconds per rank (mean over ranks); with waits they add up to the wall. The ideal is the "
          "busiest rank's render + update in the barrier run on Odin's schedule. 'At equal speed': speed-up and "
          "wait hidden with each run's wall scaled by how much faster or slower the ranks' own work (wall minus "
          "waits) ran in it than in that barrier run (a shared machine's speed drifts between runs); 'at equal "
          "CPU': the same with the processor time of the ranks' processes (every thread, a lane on a thread too) in "
          "place of the main thread's work. 'B/pair': bytes sent per visible (view, remote Gaussian) pair, to the "
          "readers / back to the owners. 'resident': per rank, the largest share of the model it owned at a step (no "
          "rank holds another's rows), then its peak bytes (owned rows with Adam's moments, the most its message "
          "buffers held at once) and their share of one process's (every row with Adam's moments), in brackets the "
          "MB its projections for its readers held at most (their graphs; with --pipeline.projection-memory "
          "recompute, or auto beyond its budget, their splats and a pair's graph at the update). 'stale/refused': "
          "block reads admitted behind the newest version, and refused (waited for). 'replayed wall': the wall the "
          "replay of the run's own lists with its measured costs predicts (odin-schedule --costs), and its error.")


def train_main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="odin-bench train", description="the policies side by side, one invocation")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--scene", default="city", help="city, city-aerial or fox")
    ap.add_argument("--data", type=Path, default=None, help="fox: another instant-ngp folder")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--out", type=Path, default=None, help="folder for the pictures (default odin-bench-SCENE)")
    ap.add_argument("--no-psnr", action="store_true", help="skip the held-out evaluation of every run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every run (alternating order); each run reports its median-wall round")
    ap.add_argument("--keep-runs", action="store_true",
                    help="keep every run's outputs (config, checkpoint, odin_stats.json) under OUT/runs")
    ap.add_argument("--thread-lane", action="store_true",
                    help="also run odin-throughput with its communication lane on a thread (--pipeline.lane thread; "
                         "inline is the default on CPU ranks)")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: ns-train arguments for every run")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        raise SystemExit("odin: error: --ranks must be at least 2 to compare synchronization policies")
    scene = scene_args(args.scene, args.data)
    extra = [a for a in args.extra if a != "--"]
    base = ["--max-num-iterations", str(args.steps), "--pipeline.recipe", "steps"]  # --steps counts steps
    out_dir = args.out or Path(f"odin-bench-{args.scene}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.repeat < 1:
        raise SystemExit("odin: error: --repeat must be at least 1")
    plan = [(label, method, order, []) for label, method, order in RUNS]
    if args.thread_lane:
        lane = next(p for p in POLICIES.values() if "lane" in p.options)
        plan.append((f"{lane.label}, lane on a thread", lane.method, "odin", ["--pipeline.lane", "thread"]))
    tries: Dict[str, List[Dict]] = {label: [] for label, _, _, _ in plan}
    with tempfile.TemporaryDirectory() as tmp:
        if args.keep_runs:
            tmp = str(out_dir / "runs")
        for rep in range(args.repeat):
            # every other round in reverse, so that a machine that slows down (or speeds up) over the invocation
            # does not favour the runs that come first
            for label, method, order, own in (plan if rep % 2 == 0 else plan[::-1]):
                print(f"odin-bench: {label} ({method}, {args.ranks} ranks, {args.steps} steps, {args.scene}"
                      f"{f', round {rep + 1} of {args.repeat}' if args.repeat > 1 else ''})", flush=True)
                flags = base + ["--pipeline.view-order", order] + own + extra + scene
                run_dir = Path(tmp) / f"{label.replace(' ', '_').replace(',', '')}{f'_{rep}' if rep else ''}"
                shutil.rmtree(run_dir, ignore_errors=True)  # a kept run of an earlier invocation
                run = run_training(args.ranks, method, flags, run_dir, label, order)
                run["replayed_wall_s"] = replayed_wall(run, flags)
                # the trained model is the same in every round (same seeds and steps): evaluate it once
                run["psnr"] = None if args.no_psnr or rep else held_out_psnr(run["config"])
                tries[label].append(run)
    runs = [median_run(tries[label]) for label, _, _, _ in plan]
    rows = compare(runs)
    title = f"{args.scene}: {args.ranks} ranks, {args.steps} steps"
    print_table(rows, title)
    window = max(0, args.steps // 2)
    pictures = [bench_figures.timeline(runs, out_dir / "timeline.png", window, min(8, args.steps)),
                bench_figures.bars(rows, rows[0]["ideal_speedup"], out_dir / "speedup.png", title)]
    print("pictures: " + ", ".join(str(p) for p in pictures))
    if args.json:
        args.json.write_text(json.dumps({"scene": args.scene, "ranks": args.ranks, "steps": args.steps,
                                         "runs": rows}, indent=2))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("render", "train", "scale", "predict", "scaling"):
        print(__doc__)
        return 2
    if argv[0] == "scaling":
        from odin_ns.cli.bench_scaling import main as scaling_main

        return scaling_main(argv[1:])
    if argv[0] == "scale":
        from odin_ns.cli.bench_scale import main as scale_main

        return scale_main(argv[1:])
    if argv[0] == "predict":
        from odin_ns.cli.bench_predict import main as predict_main

        return predict_main(argv[1:])
    if argv[0] == "render":
        from odin_ns.render.bench import main as render_main

        render_main(argv[1:])
        return 0
    return train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
