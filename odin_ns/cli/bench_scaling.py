"""`odin-bench scaling`: the same model sooner? Time to quality on N ranks against one.

    odin-bench scaling --ranks 2 --scene city|fox [--views 1500] [--seeds 42,7,11] [--repeat R] [--json F]
                       [--methods odin,odin-throughput] [--micro-batches 1,2] [-- ns-train arguments]

For each seed, one after the other in one invocation, on the same scene and number of training views (the recipe
counts views, odin_ns/recipe.py), each trained from the same seed:
- 1 rank: one view a step (splatfacto's recipe), the reference;
- 1 process with a micro-batch of N views: the same optimization as N ranks (the same recipe at B = N, the same
  result bit for bit for `odin` and `odin-barrier`): its gap to the N-rank runs is what the runtime and the waits
  cost, its gap to 1 rank what the batch does to the optimization;
- N ranks of each method asked for, and of the first with each micro-batch of `--micro-batches` above 1.
Every run gets one thread (OMP_NUM_THREADS=1 for every rank and for the one-process runs, the analogue of one GPU per
rank: N ranks use N cores). Quality is nerfstudio's own evaluation (`ns-eval`: PSNR, SSIM over every held-out view);
time is the training loop's wall (odin_stats.json, from the first step to the last, without start-up and the final
checkpoint), also the whole process's. The speed-up in time to quality is the 1-rank run's wall over the run's, at
the same views, beside the PSNR difference (what the speed-up costs in quality). `--repeat R` runs each R times
(alternating order) and takes each run's median wall; `--seeds` takes the mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table

from odin_ns.cli.bench import held_out_metrics, run_training, scene_args
from odin_ns.cli.demo import short_schedule

RUN_FILE = "bench_run.json"  # what a kept run was: label, seed, round, metrics (`--summarize` reads them)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CITY_CAPTURE = ["--num-street-cameras", "100"]  # the demo's capture (every held-out view has close neighbours)


def final_gaussians(config: Path) -> Optional[int]:
    """Gaussians in the run's last checkpoint (the model the evaluation measured)."""
    import torch

    checkpoints = sorted((config.parent / "nerfstudio_models").glob("step-*.ckpt"))
    if not checkpoints:
        return None
    state = torch.load(checkpoints[-1], map_location="cpu", weights_only=False)
    return int(state["pipeline"]["_model.gauss_params.means"].shape[0])


def runs_of(ranks: int, methods: List[str], micro_batches: List[int]) -> List[Dict]:
    """One seed's runs: the reference, the same batch in one process, N ranks of each method, and N ranks with each
    larger micro-batch of the first method (a larger global batch: what it does to quality)."""
    runs = [{"label": "1 rank", "ranks": 1, "method": "odin", "micro_batch": 1},
            {"label": f"1 process, micro-batch {ranks}", "ranks": 1, "method": "odin", "micro_batch": ranks}]
    runs += [{"label": f"{ranks} ranks, {m}", "ranks": ranks, "method": m, "micro_batch": 1} for m in methods]
    runs += [{"label": f"{ranks} ranks x micro-batch {mb}, {methods[0]}", "ranks": ranks, "method": methods[0],
              "micro_batch": mb} for mb in micro_batches if mb > 1]
    return runs


def scene_flags(scene: str, data: Optional[Path], views: int) -> List[str]:
    """The scene's data and the short CPU schedule of `views` views (the demo's, in proportion)."""
    flags = short_schedule(views) + ["--max-num-iterations", str(views), "--steps-per-save", str(10 * views)]
    args = scene_args(scene, data)
    if scene == "city":
        args = args + CITY_CAPTURE
    return flags + args


def median_round(tries: List[Dict]) -> Dict:
    """The round with the median training wall (the lower middle one of an even count)."""
    return sorted(tries, key=lambda t: t["summary"]["train_wall_s"])[(len(tries) - 1) // 2]


def render_seconds(run: Dict) -> float:
    """Seconds every rank spent rendering (forward, loss, backward), together."""
    return sum(p["render_s"] for p in run["summary"]["per_rank"])


def summarize(label: str, tries: Dict[int, List[Dict]], reference: Dict[int, List[Dict]]) -> Dict:
    """One row: per seed the median wall of its rounds, then means over seeds; speed-up and PSNR difference
    against the 1-rank run of the same seed."""
    seeds = sorted(tries)
    median = {s: median_round(tries[s]) for s in seeds}
    ref = {s: median_round(reference[s]) for s in seeds}
    wall = {s: median[s]["summary"]["train_wall_s"] for s in seeds}
    ref_wall = {s: ref[s]["summary"]["train_wall_s"] for s in seeds}
    # at equal render speed: the run's wall had its ranks rendered as fast as the reference did (the same views of a
    # model of about the same size: the same render work): its wall times the reference's render seconds over the
    # ranks' together. Everything else (updates, bookkeeping, waits) is scaled alike, none of it forgiven
    equal_speed = {s: wall[s] * render_seconds(ref[s]) / render_seconds(median[s]) for s in seeds}
    first = {s: tries[s][0] for s in seeds}
    psnr = [first[s]["metrics"]["psnr"] for s in seeds if first[s].get("metrics")]
    ssim = [first[s]["metrics"]["ssim"] for s in seeds if first[s].get("metrics")]
    ref_psnr = [reference[s][0]["metrics"]["psnr"] for s in seeds if reference[s][0].get("metrics")]
    counts = [first[s]["gaussians"] for s in seeds if first[s].get("gaussians")]
    ref_counts = [reference[s][0]["gaussians"] for s in seeds if reference[s][0].get("gaussians")]
    mean = statistics.fmean
    return {
        "label": label, "seeds": seeds, "ranks": first[seeds[0]]["ranks"],
        "views": first[seeds[0]]["summary"]["views"],
        "steps": first[seeds[0]]["summary"]["steps"],
        "train_wall_s": mean(wall.values()), "train_wall_s_per_seed": [wall[s] for s in seeds],
        "process_wall_s": (mean(median[s]["process_wall_s"] for s in seeds)
                           if all(median[s].get("process_wall_s") for s in seeds) else None),
        "speedup": mean(ref_wall[s] / wall[s] for s in seeds),
        "speedup_per_seed": [ref_wall[s] / wall[s] for s in seeds],
        "speedup_equal_speed": mean(ref_wall[s] / equal_speed[s] for s in seeds),
        "speedup_equal_speed_per_seed": [ref_wall[s] / equal_speed[s] for s in seeds],
        "render_s_per_seed": [render_seconds(median[s]) for s in seeds],
        "psnr": mean(psnr) if psnr else None, "psnr_per_seed": psnr,
        "ssim": mean(ssim) if ssim else None,
        "psnr_delta": mean(psnr) - mean(ref_psnr) if psnr and ref_psnr else None,
        "gaussians": mean(counts) if counts else None,
        "gaussians_ratio": mean(counts) / mean(ref_counts) if counts and ref_counts else None,
    }


def print_rows(rows: List[Dict], title: str) -> None:
    table = Table(title=title)
    for col in ("run", "steps", "training wall (s)", "speed-up in time to quality", "at equal render speed",
                "PSNR (dB)", "vs 1 rank", "SSIM", "Gaussians (vs 1 rank)", "whole process (s)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["label"], str(r["steps"]), f"{r['train_wall_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['speedup_equal_speed']:.2f}x",
                      "-" if r["psnr"] is None else f"{r['psnr']:.2f}",
                      "-" if r["psnr_delta"] is None else f"{r['psnr_delta']:+.2f}",
                      "-" if r["ssim"] is None else f"{r['ssim']:.3f}",
                      "-" if r["gaussians"] is None else f"{r['gaussians']:.0f} ({r['gaussians_ratio']:.2f}x)",
                      "-" if r["process_wall_s"] is None else f"{r['process_wall_s']:.1f}")
    Console(width=200).print(table)
    print("Every run trains the same views with the recipe counted in views (on B views a step every interval / B, "
          "Grendel-GS's sqrt rule for the optimizer), one thread per rank. Speed-up: the 1-rank run's training wall "
          "over the run's, seed by seed, then the mean; at equal render speed: the same with the run's wall scaled by "
          "the reference's render seconds over the ranks' together (the same render work): a shared machine's "
          "speed drifts between runs, and ranks that share its cores slow each other, which one GPU per rank does "
          "not. PSNR and SSIM: nerfstudio's evaluation of every held-out view, the mean over seeds.")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="odin-bench scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--scene", default="city", help="city or fox (or city-aerial)")
    ap.add_argument("--data", type=Path, default=None, help="fox: another instant-ngp folder")
    ap.add_argument("--views", type=int, default=1500, help="training views of every run")
    ap.add_argument("--seeds", default="42", help="comma-separated seeds (--machine.seed); the mean is reported")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every run (alternating order); median wall")
    ap.add_argument("--methods", default="odin,odin-throughput", help="the N-rank runs")
    ap.add_argument("--micro-batches", default="1",
                    help="comma list: N-rank runs of the first method with each micro-batch above 1 too (B = N x it)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--keep-runs", type=Path, default=None, help="keep every run's outputs in this folder")
    ap.add_argument("--summarize", type=Path, default=None,
                    help="train nothing: the table of the runs an earlier invocation kept in this folder")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: ns-train arguments for every run")
    args = ap.parse_args(argv)
    if args.summarize is not None:
        return summarize_kept(args.summarize, args.json)
    if args.ranks < 2 or args.repeat < 1 or args.views < 1:
        raise SystemExit("odin: error: --ranks must be at least 2, --repeat and --views at least 1")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        raise SystemExit(f"odin: error: --seeds takes comma-separated integers (got {args.seeds!r})") from None
    methods = [m for m in args.methods.split(",") if m]
    micro_batches = [int(m) for m in args.micro_batches.split(",") if m]
    scene = scene_flags(args.scene, args.data, args.views)
    extra = [a for a in args.extra if a != "--"]
    plan = runs_of(args.ranks, methods, micro_batches)
    tries: Dict[str, Dict[int, List[Dict]]] = {p["label"]: {s: [] for s in seeds} for p in plan}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep_runs or Path(tmp)
        for seed in seeds:
            for rep in range(args.repeat):
                for p in (plan if rep % 2 == 0 else plan[::-1]):
                    print(f"odin-bench scaling: {p['label']} ({args.views} views of {args.scene}, seed {seed}"
                          f"{f', round {rep + 1} of {args.repeat}' if args.repeat > 1 else ''})", flush=True)
                    mb = ["--pipeline.micro-batch", str(p["micro_batch"])] if p["micro_batch"] > 1 else []
                    flags = ["--machine.seed", str(seed)] + mb + extra + scene
                    out = root / f"{p['label'].replace(' ', '_').replace(',', '')}_s{seed}_r{rep}"
                    shutil.rmtree(out, ignore_errors=True)
                    run = run_training(p["ranks"], p["method"], flags, out, p["label"], "odin", env=ONE_THREAD)
                    if rep == 0:  # the same seed trains the same model in every round: evaluate it once
                        run["metrics"] = held_out_metrics(run["config"])
                        run["gaussians"] = final_gaussians(run["config"])
                    run.pop("records")
                    tries[p["label"]][seed].append(run)
                    (out / RUN_FILE).write_text(json.dumps(
                        {"order": plan.index(p), "label": p["label"], "seed": seed, "round": rep, "ranks": p["ranks"],
                         "method": p["method"], "micro_batch": p["micro_batch"], "scene": args.scene,
                         "views": args.views, "process_wall_s": run["process_wall_s"],
                         "metrics": run.get("metrics"), "gaussians": run.get("gaussians")}))
    report(tries, [p["label"] for p in plan], args.scene, args.views, args.ranks, seeds, args.json,
           {"repeat": args.repeat, "extra": extra})
    return 0


def report(tries: Dict[str, Dict[int, List[Dict]]], labels: List[str], scene: str, views: int, ranks: int,
           seeds: List[int], json_path: Optional[Path], more: Dict) -> List[Dict]:
    """The table (and the JSON) of an invocation's runs; the first label is the reference."""
    reference = tries[labels[0]]
    rows = [summarize(label, tries[label], reference) for label in labels]
    print_rows(rows, f"time to quality: {scene}, {views} views, {ranks} ranks against 1, seeds "
                     f"{','.join(map(str, seeds))}")
    if json_path:
        json_path.write_text(json.dumps({"scene": scene, "views": views, "ranks": ranks, "seeds": seeds, **more,
                                         "rows": rows}, indent=2))
    return rows


def summarize_kept(folder: Path, json_path: Optional[Path]) -> int:
    """`--summarize DIR`: the table of the runs an earlier invocation kept there (`--keep-runs DIR`)."""
    found = sorted(folder.glob(f"*/{RUN_FILE}"))
    if not found:
        raise SystemExit(f"odin: error: no kept runs under {folder} (an invocation with --keep-runs {folder} keeps "
                         "them)")
    tries: Dict[str, Dict[int, List[Dict]]] = {}
    order: Dict[str, int] = {}
    kept = [json.loads(path.read_text()) for path in found]
    for path, meta in zip(found, kept):
        stats = json.loads(next(path.parent.glob("**/odin_stats.json")).read_text())
        tries.setdefault(meta["label"], {}).setdefault(meta["seed"], []).append(dict(meta, summary=stats["summary"]))
        order[meta["label"]] = meta["order"]
    labels = sorted(tries, key=order.get)
    seeds = sorted({meta["seed"] for meta in kept})
    report(tries, labels, kept[0]["scene"], kept[0]["views"], max(meta["ranks"] for meta in kept), seeds,
           json_path, {"kept": str(folder)})
    return 0
