"""`odin-demo`: Odin on 2 real ranks on the built-in city, then what it gives: held-out PSNR, a held-out view beside
its ground truth, the three policies side by side with a per-rank timeline, and the commands that open the result.

    odin-demo                                   # what `make demo` runs: a few minutes on 2 CPU cores
    odin-demo --ranks 3 --max-num-iterations 500 --compare-steps 0

Every argument the demo does not know is an `ns-train odin` argument (given after the demo's short CPU schedule,
so it wins); a data parser sub-command with its options (`odin-city --width 64 ...`) replaces the demo's city.
The training runs through `odin-train` (torchrun, gloo or NCCL ranks), the evaluation is nerfstudio's own
(`eval_setup`, the average over every held-out view, as `ns-eval`), the comparison is `odin-bench`'s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from odin_ns.cli import bench, bench_figures
from odin_ns.cli.train import OneLineParser
from odin_ns.schedule.policies import POLICIES

# the short schedule sized for the built-in scene on a CPU (splatfacto's own is 30000 views): 1500 views, counted in
# views as the recipe counts them (odin_ns/recipe.py: on 2 ranks, 750 steps of 2 views); the length of the training,
# then the model's schedule (also that of the comparison's runs)
VIEWS = 1500
STEPS = ["--max-num-iterations", str(VIEWS), "--steps-per-save", "2000", "--steps-per-eval-image", "100000",
         "--steps-per-eval-all-images", "100000", "--steps-per-eval-batch", "0", "--vis", "tensorboard"]


def short_schedule(views: int) -> List[str]:
    """splatfacto's schedule shortened to `views` training views (the demo's 1500, in proportion for others):
    warm-up, refine interval, densification stop, SH degree interval, resolution schedule, the means' decay."""
    def part(num: int, den: int) -> str:
        return str(max(1, views * num // den))

    return [
        "--pipeline.model.num-downscales", "1", "--pipeline.model.resolution-schedule", part(1, 3),
        "--pipeline.model.warmup-length", part(2, 15), "--pipeline.model.refine-every", part(1, 15),
        "--pipeline.model.reset-alpha-every", "10", "--pipeline.model.stop-split-at", part(4, 5),
        "--pipeline.model.sh-degree-interval", part(4, 15),
        # screen-size splitting: 5% of a 128-pixel image is 6 pixels, far too eager
        "--pipeline.model.stop-screen-size-at", "0",
        "--optimizers.means.scheduler.max-steps", str(views),
    ]


MODEL = short_schedule(VIEWS)
# a denser street capture than the parser's default, so that every held-out view has close neighbours
CITY = ["odin-city", "--num-street-cameras", "100"]
DATAPARSERS = ("odin-city", "odin-data", "instant-ngp-data", "nerfstudio-data", "colmap", "blender-data")
COMPARED = [(p.label, p.method) for p in sorted(POLICIES.values(), key=lambda p: not p.barrier)]


def parse(argv: List[str]):
    ap = OneLineParser(prog="odin-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the training (real processes)")
    ap.add_argument("--compare-steps", type=int, default=75,
                    help="steps of each policy's run in the side-by-side comparison (0: no comparison)")
    ap.add_argument("--compare-rounds", type=int, default=2,
                    help="rounds of the comparison, in alternating order, taken together")
    ap.add_argument("--output-dir", type=Path, default=Path("outputs"), help="where the runs go")
    known, rest = ap.parse_known_args(argv)
    if known.ranks < 1:
        ap.error(f"--ranks must be at least 1 (got {known.ranks})")
    if known.compare_steps < 0:
        ap.error(f"--compare-steps must be 0 or more (got {known.compare_steps})")
    if known.compare_rounds < 1:
        ap.error(f"--compare-rounds must be at least 1 (got {known.compare_rounds})")
    if known.compare_steps and known.ranks < 2:
        ap.error("the comparison of policies needs --ranks 2 or more (or --compare-steps 0)")
    cut = next((i for i, a in enumerate(rest) if a in DATAPARSERS), len(rest))
    return known, rest[:cut], rest[cut:] or list(CITY)


def newest_config(folder: Path) -> Path:
    configs = sorted(folder.glob("**/config.yml"), key=lambda p: p.stat().st_mtime)
    if not configs:
        raise SystemExit(f"odin: error: the training wrote no config.yml under {folder}")
    return configs[-1]


def evaluate(config_path: Path, picture: Path) -> Dict:
    """nerfstudio's evaluation of the final checkpoint over every held-out view, and one of them (the middle one)
    rendered beside its ground truth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from nerfstudio.utils.eval_utils import eval_setup

    _, pipeline, checkpoint, step = eval_setup(config_path)
    dataset = pipeline.datamanager.eval_dataset
    index = len(dataset) // 2
    with torch.no_grad():
        outputs = pipeline.model.get_outputs_for_camera(dataset.cameras[index:index + 1].to(pipeline.device))
        batch = {k: v.to(pipeline.device) if torch.is_tensor(v) else v for k, v in dataset[index].items()}
        view_metrics, images = pipeline.model.get_image_metrics_and_images(outputs, batch)
    both = images["img"].clamp(0, 1).cpu().numpy()  # ground truth | render, side by side
    width = both.shape[1] // 2
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.5 * both.shape[0] / max(1, width)))
    for ax, image, title in zip(axes, (both[:, width:], both[:, :width]),
                                (f"render, step {step} ({view_metrics['psnr']:.2f} dB)", "ground truth")):
        ax.imshow(image)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.suptitle(f"held-out view {index} of {len(dataset)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(picture, dpi=120)
    plt.close(fig)
    metrics = pipeline.get_average_eval_image_metrics(step=step)  # (it leaves the pipeline in training mode)
    return {"step": step, "checkpoint": str(checkpoint), "eval_views": len(dataset), **metrics}


def compare(ranks: int, steps: int, flags: List[str], scene: List[str], folder: Path, rounds: int = 2):
    """`odin-bench train`'s runs, on the demo's scene: barrier, odin and odin-throughput on Odin's schedule, in
    `rounds` rounds, every other one in reverse order, each policy's rounds taken together (a machine that speeds
    up or slows down over the comparison favours no policy)."""
    tries: Dict[str, List[Dict]] = {label: [] for label, _ in COMPARED}
    for rep in range(rounds):
        for label, method in (COMPARED if rep % 2 == 0 else COMPARED[::-1]):
            print(f"odin-demo: {label} for {steps} steps on {ranks} ranks (the side-by-side comparison, round "
                  f"{rep + 1} of {rounds})", flush=True)
            tries[label].append(bench.run_training(
                ranks, method, MODEL + flags + ["--max-num-iterations", str(steps * ranks)] + scene,
                folder / f"{method}-{rep}", label, "odin"))
    rows = bench.compare([bench.pooled_run(tries[label]) for label, _ in COMPARED])
    firsts = [tries[label][0] for label, _ in COMPARED]
    timeline = bench_figures.timeline(firsts, folder / "timeline.png", steps // 2, min(8, steps))
    return rows, timeline


def print_comparison(rows: List[Dict], steps: int, ranks: int, rounds: int = 1) -> None:
    from rich.table import Table

    from nerfstudio.utils.rich_utils import CONSOLE

    table = Table(title=f"the policies side by side: {ranks} ranks, {steps} steps"
                        f"{f' x {rounds} rounds in alternating order' if rounds > 1 else ''}, the same schedule")
    for col in ("policy", "views/s", "speed-up", "ideal", "wait hidden", "at equal compute speed", "at equal CPU"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["label"], f"{r['views_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['ideal_speedup']:.2f}x",
                      f"{r['wait_hidden']:.0%}",
                      f"{r['speedup_equal_speed']:.2f}x, {r['wait_hidden_equal_speed']:.0%} hidden",
                      f"{r['speedup_equal_cpu']:.2f}x, {r['wait_hidden_equal_cpu']:.0%} hidden")
    CONSOLE.print(table)
    CONSOLE.print("speed-up over barrier; ideal: the barrier run without its waits; wait hidden: the share of "
                  "barrier's wait the policy removes. On a shared machine the same work runs at speeds that drift "
                  "by 10-25% from run to run: the last columns scale each run to the barrier run's compute speed "
                  "(its ranks' own work, wall minus waits; or the processor time of their processes, every "
                  "thread), which cancels that drift; the raw columns do not. `odin-bench train` measures longer "
                  "and repeated.")


def main(argv: Optional[List[str]] = None) -> int:
    known, flags, scene = parse(sys.argv[1:] if argv is None else argv)
    out = known.output_dir
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "odin_ns.cli.train", "--ranks", str(known.ranks), "odin", "--output-dir", str(out),
           "--experiment-name", "odin-demo", *STEPS, *MODEL, *flags, *scene]
    code = subprocess.call(cmd)
    if code != 0:
        return code  # the launcher has said why
    train_seconds = time.perf_counter() - started
    config = newest_config(out / "odin-demo")
    run = config.parent
    print("odin-demo: evaluating the held-out views", flush=True)
    metrics = evaluate(config, run / "heldout.png")
    pictures = [run / "heldout.png"]
    rows = []
    if known.compare_steps:
        rows, timeline = compare(known.ranks, known.compare_steps, flags, scene, run / "compare",
                                 known.compare_rounds)
        pictures.append(timeline)
    (run / "demo_metrics.json").write_text(json.dumps(
        {"ranks": known.ranks, "train_seconds": train_seconds, "metrics": metrics,
         "comparison": {"steps": known.compare_steps, "rounds": known.compare_rounds, "runs": rows}},
        indent=2, default=str))

    from nerfstudio.utils.rich_utils import CONSOLE

    CONSOLE.rule("odin demo")
    if rows:
        print_comparison(rows, known.compare_steps, known.ranks, known.compare_rounds)
    CONSOLE.print(f"trained `odin` on {known.ranks} ranks for {metrics['step'] + 1} steps in {train_seconds:.0f} s: "
                  f"held-out PSNR {metrics['psnr']:.2f} dB, SSIM {metrics['ssim']:.3f} over {metrics['eval_views']} "
                  "views")
    CONSOLE.print(f"outputs:  {run}", soft_wrap=True)
    CONSOLE.print("pictures: " + ", ".join(str(p) for p in pictures), soft_wrap=True)
    CONSOLE.print("open it:")
    CONSOLE.print(f"  ns-viewer --load-config {config}", soft_wrap=True)
    CONSOLE.print(f"  ns-export gaussian-splat --load-config {config} --output-dir {run / 'export'}", soft_wrap=True)
    CONSOLE.print(f"  ns-eval --load-config {config} --output-path {run / 'eval.json'}", soft_wrap=True)
    minutes, seconds = divmod(round(time.perf_counter() - started), 60)
    CONSOLE.print(f"odin-demo: done in {minutes} min {seconds} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
