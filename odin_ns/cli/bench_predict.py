"""`odin-bench predict`: the policies at rank counts this machine cannot run, replayed on a clock.

    odin-bench predict [--ranks 8,16] [--scenes city,city-aerial,fox,garden] [--link pcie] [--gpu published]
                       [--steps 100] [--micro-batch 2] [--json FILE] [--out DIR]
    odin-bench predict --ranks 64 --scenes matrixcity --peer      # and over Grendel-GS's model
    odin-bench predict --ranks 1,4,8 --gpu h200 --link nvlink       # time to 30000 views against one GPU

For each rank count and scene it builds the plan a run would make (the built-in scenes and the fox through the
same start-up as training, `schedule.preview`; the garden point cloud and the generated city from their geometry,
`schedule.geometry_plan`), takes every policy's action lists from the registry (the lists the runtime's
interpreter runs) and replays them (`schedule.simulate`) with a GPU's per-view and per-update costs
(`schedule.gpu_costs`) and a link's latency and bandwidth (`schedule.links`). Per policy it prints the predicted
views/s, the speed-up over `odin-barrier`, the ideal (barrier's wall over its busiest rank's render + update) and
the share of barrier's wait hidden, the time to train `--views` views (30000, splatfacto's recipe: the recipe
counts views, so every rank count trains the same), and with 1 among `--ranks` the speed-up over the same scene
replayed on one GPU, beside Grendel-GS's published figure; and draws them (predict.png). A scene's points stand
for a scene of `--gaussians` (default per scene: what gsplat or Grendel-GS trained on such a scene), its views render at the
scene's training resolution.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table
import torch

from odin_ns.cli.bench import DEFAULT_FOX, QUIET_RUN, SCENES
from odin_ns.runtime.projection_memory import GRAPH_ROW_BYTES, keep_budget
from odin_ns.schedule.gpu_costs import DATA_PATHS, GPUS, describe, gpu_costs, pair_rows
from odin_ns.schedule.links import LINKS, link as link_named
from odin_ns.schedule.peer_model import MODEL as PEER_MODEL
from odin_ns.schedule.policies import POLICIES

GARDEN = DEFAULT_FOX.parent / "garden_points.npz"
# Gaussians a scene stands for, and the pixels of a view: gsplat's garden (5.84M at 1297x840), gsplat's mean of
# Mip-NeRF 360 with its default settings (3.24M) for the built-in cities, its small indoor scenes (1.2M) for the
# fox, Grendel-GS's MatrixCity model (24M) at 1920x1080
SCENE_SIZE = {"city": (3.24e6, 1297 * 840), "city-aerial": (3.24e6, 1297 * 840), "fox": (1.2e6, 960 * 540),
              "garden": (5.84e6, 1297 * 840), "matrixcity": (24e6, 1920 * 1080)}
BARRIER = next(p.method for p in POLICIES.values() if p.barrier)


def _scene_preview(scene: str, ranks: int, steps: int, phase_length: int, micro_batch: int,
                   view_order: str = "odin"):
    """The scene's plans on `ranks` ranks, with blocks small enough for every rank to own several, the views in
    `view_order` (Odin's, or nerfstudio's random order)."""
    if scene in ("garden", "matrixcity"):
        from odin_ns.schedule import predict_scenes
        from odin_ns.schedule.geometry_plan import preview_from_geometry

        if scene == "garden":
            if not GARDEN.exists():
                raise SystemExit(f"odin: error: the garden point cloud is not at {GARDEN}")
            geo = predict_scenes.garden(GARDEN)
        else:
            geo = predict_scenes.matrix_city()
        points = geo["means"].shape[0]
        block_size = max(64, min(4096, points // (ranks * 32)))
        return preview_from_geometry(geo["means"], geo["scales"], geo["viewmats"], geo["Ks"], geo["width"],
                                     geo["height"], ranks, steps, block_size, micro_batch=micro_batch,
                                     phase_length=phase_length, pixels=SCENE_SIZE[scene][1], view_order=view_order)
    from odin_ns.cli.schedule import _method_config
    from odin_ns.schedule.preview import build_preview

    args = list(SCENES[scene])
    if "--pipeline.block-size" in args:
        i = args.index("--pipeline.block-size")
        del args[i:i + 2]
    if scene == "fox":
        if not (DEFAULT_FOX / "transforms.json").exists():
            raise SystemExit(f"odin: error: the fox photos are not at {DEFAULT_FOX} (leave fox out of --scenes)")
        args = ["--data", str(DEFAULT_FOX)] + args
    # a run as the benchmarks make them: no viewer and no evaluation, each a collective on the default group
    # (a whole-model gather to rank 0, renders from every owner's splats) that ends its phase on several ranks
    config = _method_config(["odin", *QUIET_RUN, "--pipeline.phase-length", str(phase_length), "--pipeline.block-size",
                             str(64 if ranks > 4 else 256), "--pipeline.micro-batch", str(micro_batch),
                             "--pipeline.view-order", view_order] + args)
    preview = build_preview(config, ranks, steps)
    preview.pixels = [SCENE_SIZE[scene][1]] * preview.num_views
    return preview


def predict_scene(scene: str, ranks: int, steps: int, gpu: str, link: str, phase_length: int = 25,
                  gaussians: Optional[float] = None, micro_batch: int = 1, data_path: str = "splats",
                  projection_memory: str = "auto", projection_budget_mb: Optional[float] = None,
                  peer: bool = False) -> Dict:
    """Every policy's replay of `scene` on `ranks` GPUs; with `peer`, also Grendel-GS's model
    (`schedule.peer_model`) on the same scene, GPU and link, and every policy's speed-up over it."""
    from odin_ns.cli.schedule import predictions

    # auto's budget: a share of the GPU model's memory on several, as the runtime's of the GPU it runs on, none on
    # one GPU (plain training's graphs)
    budget = keep_budget(projection_memory, projection_budget_mb, GPUS[gpu].memory_bytes, ranks)
    target = gaussians or SCENE_SIZE[scene][0]

    def replay(view_order: str):
        preview = _scene_preview(scene, ranks, steps, phase_length, micro_batch, view_order)
        scale = target / max(sum(preview.block_counts), 1)
        plans = preview.policy_plans()
        stale = next(plans[p.method] for p in POLICIES.values() if p.stale_reads)
        costs = gpu_costs(preview.plans, preview.gaussians_read, preview.pixels, preview.block_counts, scale,
                          GPUS[gpu], link_named(link), preview.visible, data_path, stale_plans=stale,
                          keep_budget=budget, planning_s=preview.planning_s, gather_bytes=preview.gather_bytes)
        views = sum(len(v) for plan in preview.plans for step in plan.views for v in step)
        return preview, plans, costs, scale, views

    preview, plans, costs, scale, views = replay("odin")
    pred = predictions(plans, costs)
    peak = peak_bytes(plans[BARRIER], costs, scale, budget)
    for p in pred.values():
        p["views_per_s"] = views / p["wall_s"]
        p["ideal_speedup"] = pred[BARRIER]["wall_s"] / p["ideal_s"]
    row = {"scene": scene, "ranks": ranks, "gaussians": target, "blocks": len(preview.block_counts),
           "views": preview.num_views, "steps": steps, "micro_batch": micro_batch, "data_path": data_path,
           "policies": pred, "peak_bytes_per_rank": max(peak), "one_gpu_bytes": ROW_BYTES * 3 * target,
           "planning_s": sum(preview.planning_s), "phase_start_s": sum(costs.phase_start),
           "phases": len(preview.plans), "threads": torch.get_num_threads()}
    if peer:
        from odin_ns.schedule.peer_model import balanced_costs
        from odin_ns.schedule.simulate import simulate

        _, random_plans, random_costs, _, random_views = replay("random")
        wall = simulate(random_plans[BARRIER], balanced_costs(random_costs, ranks)).wall_s
        row["peer"] = {"views_per_s": random_views / wall}
        for p in pred.values():
            p["speedup_over_peer"] = p["views_per_s"] / row["peer"]["views_per_s"]
    return row


ROW_BYTES = 4 * 59  # a Gaussian's packed parameters at SH degree 3 (Adam's two moments hold the same again twice)
def peak_bytes(plans, costs, scale: float, keep_budget: float = 0.0) -> List[float]:
    """Per rank, the most bytes it holds at a step of the replay: its owned rows with Adam's two moments, plus the
    step's messages it sends and receives (as the data path prices them), plus the graphs of every pair (reader's
    view, this rank's rows it reads) of the step, kept from P to U where they hold at most `keep_budget` bytes, else
    the graph of the largest pair, which it projects again at its update. On the splat path nothing else: no rank
    holds another rank's rows."""
    R = plans[0].num_ranks
    peak = [0.0] * R
    for plan in plans:
        owned = [0.0] * R
        for o, n in zip(plan.owner, plan.counts):
            owned[o] += n
        messages: Dict = {}
        for r in range(R):
            for a in plan.actions(r):
                if a.kind in ("P", "G"):
                    size = costs.message_bytes(r, a)
                    for who in (r, a.peer):
                        messages[(a.step, who)] = messages.get((a.step, who), 0.0) + size
        counts = torch.as_tensor(plan.counts, dtype=torch.float64)
        graph = {}  # step -> [ranks] the graphs an owner holds at its update
        for step in range(plan.start, plan.stop):
            rows = pair_rows(plan, step, counts)
            kept = GRAPH_ROW_BYTES * scale * rows.sum(0)
            graph[step] = torch.where(kept <= keep_budget, kept, GRAPH_ROW_BYTES * scale * rows.amax(0))
        for r in range(R):
            most = max((messages.get((step, r), 0.0) + float(graph[step][r]) for step in range(plan.start, plan.stop)),
                       default=0.0)
            peak[r] = max(peak[r], 3 * ROW_BYTES * scale * owned[r] + most)
    return peak


# Grendel-GS's README: "more than 3.5x" faster training on Mip-NeRF 360 with 4 GPUs (batch 4, sqrt learning rates)
PEERS = "Grendel-GS publishes more than 3.5x at 4 GPUs (Mip-NeRF 360, batch 4, its README)"


def add_time_to_views(rows: List[Dict], views: int) -> None:
    """Per row and policy: the time to train `views` views at the replayed views/s, and, where the same scene was
    replayed on one rank, the speed-up over that one-GPU replay (the same visibility and costs, one rank's plan)."""
    one = {r["scene"]: r for r in rows if r["ranks"] == 1}
    for r in rows:
        for name, p in r["policies"].items():
            p["time_to_views_s"] = views / p["views_per_s"]
            single = one.get(r["scene"])
            p["speedup_over_one_gpu"] = (p["views_per_s"] / single["policies"][name]["views_per_s"]
                                         if single is not None else None)


def print_rows(rows: List[Dict], gpu: str, link: str, views: int = 30000) -> None:
    mb = rows[0]["micro_batch"] if rows else 1
    path = rows[0].get("data_path", "rows") if rows else "rows"
    table = Table(title=f"predicted: {gpu} GPUs, {link} link, {mb} view(s) per rank per step, messages of {path}; "
                        "views/s and against odin-barrier")
    peer = any("peer" in r for r in rows)
    for col in ("ranks", "scene", "Gaussians", "blocks", "policy", "views/s", "speed-up", "ideal", "wait hidden",
                f"{views} views in", "vs 1 GPU", "peak GB/rank") + (("vs Grendel-GS model",) if peer else ()):
        table.add_column(col, justify="right")
    for r in rows:
        head = (str(r["ranks"]), r["scene"], f"{r['gaussians'] / 1e6:.2f}M", str(r["blocks"]))
        for name, p in r["policies"].items():
            table.add_row(*head, name,
                          f"{p['views_per_s']:.1f}", f"{p['speedup']:.2f}x", f"{p['ideal_speedup']:.2f}x",
                          "-" if name == BARRIER else f"{p['wait_hidden']:.0%}",
                          f"{p['time_to_views_s'] / 60:.1f} min",
                          "-" if p.get("speedup_over_one_gpu") is None else f"{p['speedup_over_one_gpu']:.2f}x",
                          "-" if name != BARRIER or "peak_bytes_per_rank" not in r else
                          f"{r['peak_bytes_per_rank'] / 1e9:.2f} "
                          f"({r['peak_bytes_per_rank'] / r['one_gpu_bytes']:.0%})",
                          *((f"{p['speedup_over_peer']:.2f}x",) if "peer" in r else ("-",) if peer else ()))
        if "peer" in r:
            v = r["peer"]["views_per_s"]
            table.add_row(*head, PEER_MODEL, f"{v:.1f}", f"{v / r['policies'][BARRIER]['views_per_s']:.2f}x", "-",
                          "-", f"{views / v / 60:.1f} min", "-", "-", "1.00x")
    Console(width=200 if peer else 180).print(table)
    print("peak GB/rank: the most a rank of odin-barrier holds at a step of the replay (owned rows with Adam's "
          "moments, the step's messages, the graphs of the step's projections it keeps until its update, or, beyond "
          "the kept graphs' budget, the graph of the largest pair it projects again there), and its share of one GPU "
          "holding the whole model with its moments.")
    for r in rows:
        if r.get("phases"):
            print(f"phase starts, {r['ranks']} rank(s), {r['scene']}: a rank's planning "
                  f"{1000 * r['planning_s'] / r['phases']:.1f} ms a phase (timed here, {r['threads']} thread(s), "
                  f"one process standing for a rank), a phase start with the read sets' all-gather "
                  f"{1000 * r['phase_start_s'] / r['phases']:.1f} ms: "
                  f"{r['phase_start_s'] / r['policies'][BARRIER]['wall_s']:.0%} of odin-barrier's wall")
    if any(r["ranks"] == 1 for r in rows):
        print(f"vs 1 GPU: views/s over the same scene replayed on one rank; the recipe counts views, so this is the "
              f"speed-up in time to the same training. {PEERS}.")
    for ranks in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == ranks]
        for name in mine[0]["policies"]:
            if name == BARRIER:
                continue
            n = len(mine)
            speed = sum(r["policies"][name]["speedup"] for r in mine) / n
            hidden = sum(r["policies"][name]["wait_hidden"] for r in mine) / n
            ideal = sum(r["policies"][name]["ideal_speedup"] for r in mine) / n
            over = [r["policies"][name]["speedup_over_peer"] for r in mine if "peer" in r]
            print(f"{ranks} ranks, mean over {n} scene(s): {name} {speed:.2f}x barrier (ideal {ideal:.2f}x), "
                  f"{hidden:.0%} of its wait hidden"
                  + (f"; {sum(over) / len(over):.2f}x the Grendel-GS model" if over else ""))
    if peer:
        print(f"{PEER_MODEL}: odin-barrier's lists on nerfstudio's random view order, each step's renders shared "
              "evenly by the ranks (its load balancer at best), splats all-to-all (schedule/peer_model.py): an "
              "estimate, without Grendel-GS's own overheads and with our runtime's (phase boundaries, its time per "
              "step).")


def draw(rows: List[Dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['scene']}\n{r['ranks']} ranks" for r in rows]
    names = list(rows[0]["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(rows))]
        axes[0].bar(xs, [r["policies"][name]["speedup"] for r in rows], width, label=name)
        if name != BARRIER:
            axes[1].bar(xs, [100 * r["policies"][name]["wait_hidden"] for r in rows], width, label=name)
    axes[0].plot([i + 0.4 - width / 2 for i in range(len(rows))], [r["policies"][BARRIER]["ideal_speedup"]
                                                                 for r in rows], "k_", markersize=20, label="ideal")
    axes[0].set_ylabel("speed-up over odin-barrier")
    axes[1].set_ylabel("barrier's wait hidden (%)")
    for ax in axes:
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kept(budget: float) -> str:
    if budget == math.inf:
        return "every graph"
    if budget == 0:
        return "no graph (each pair projected again at the update)"
    return f"a step's graphs while they hold at most {budget / 1e9:.1f} GB a rank"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="odin-bench predict", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,16", help="rank counts, comma list (default 8,16)")
    ap.add_argument("--scenes", default="city,city-aerial,fox,garden",
                    help=f"comma list of {', '.join(SCENE_SIZE)} (default: all but matrixcity)")
    ap.add_argument("--link", default="pcie", choices=sorted(LINKS))
    ap.add_argument("--gpu", default="published", choices=sorted(GPUS))
    ap.add_argument("--steps", type=int, default=100, help="steps replayed (default 100)")
    ap.add_argument("--phase-length", type=int, default=25, help="steps between global synchronizations")
    ap.add_argument("--gaussians", type=float, default=None, help="Gaussians every scene stands for")
    ap.add_argument("--micro-batch", type=int, default=2,
                    help="views per rank per step (default 2, as the paper's test bed)")
    ap.add_argument("--data-path", default="splats", choices=DATA_PATHS,
                    help="what the messages carry: splats (default: what the runtime moves, as gsplat's distributed "
                         "mode) or rows (parameter rows out, gradient rows back: the data path before splats)")
    ap.add_argument("--projection-memory", default="auto", choices=("auto", "recompute", "keep"),
                    help="what an owner holds of its projections until its update (--pipeline.projection-memory; "
                         "recompute projects again at the update: priced in the update and one pair's graph in the "
                         "peak; keep: every pair's graph in the peak; auto, the default: keep while a step's graphs "
                         "hold at most a quarter of the GPU's memory (or --projection-budget-mb, at one rank too), "
                         "recompute beyond; one GPU keeps)")
    ap.add_argument("--projection-budget-mb", type=float, default=None,
                    help="auto's budget of kept graphs per rank (--pipeline.projection-budget-mb)")
    ap.add_argument("--views", type=int, default=30000,
                    help="training views the time column counts (default splatfacto's 30000); with 1 among --ranks "
                         "every rank count is also compared with one GPU")
    ap.add_argument("--peer", action="store_true",
                    help="also replay Grendel-GS's model (schedule/peer_model.py: the barrier on nerfstudio's random "
                         "order, a step's renders balanced over the ranks) and every policy's speed-up over it")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("odin-bench-predict"), help="folder for predict.png")
    args = ap.parse_args(argv)
    scenes = args.scenes.split(",")
    for s in scenes:
        if s not in SCENE_SIZE:
            raise SystemExit(f"odin: error: unknown scene {s!r} (choose from {', '.join(SCENE_SIZE)})")
    ranks = [int(r) for r in args.ranks.split(",")]
    print(describe(GPUS[args.gpu], link_named(args.link)), flush=True)
    kept = [(where, keep_budget(args.projection_memory, args.projection_budget_mb, GPUS[args.gpu].memory_bytes, n))
            for where, n in (("several GPUs", 2), ("one GPU", 1))]
    print(f"projections ({args.projection_memory}), what an owner keeps of them until its update: "
          + "; ".join(f"{where}: {_kept(budget)}" for where, budget in kept), flush=True)
    rows = []
    for r in ranks:
        for s in scenes:
            print(f"odin-bench predict: {s}, {r} ranks, {args.steps} steps", flush=True)
            rows.append(predict_scene(s, r, args.steps, args.gpu, args.link, args.phase_length, args.gaussians,
                                      args.micro_batch, args.data_path, args.projection_memory,
                                      args.projection_budget_mb, args.peer))
    add_time_to_views(rows, args.views)
    print_rows(rows, args.gpu, args.link, args.views)
    args.out.mkdir(parents=True, exist_ok=True)
    draw(rows, args.out / "predict.png")
    print(f"pictures: {args.out / 'predict.png'}")
    if args.json:
        args.json.write_text(json.dumps({"gpu": args.gpu, "link": args.link, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
