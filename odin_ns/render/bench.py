"""Forward+backward timing of the renderer (a benchmark, not a test): the CPU rasterizer, or gsplat's kernels.

    python -m odin_ns.render.bench                 # the three reference sizes, 2 threads
    python -m odin_ns.render.bench --sizes 50000x256x256 --repeats 5 --profile
    python -m odin_ns.render.bench --device cuda --sizes 1000000x1297x840   # gsplat (a per-view cost on a GPU)
    python -m odin_ns.render.bench --halves --device cuda --sizes 1000000x1297x840 6000000x1297x840 --outside 0.5

`--halves` times the two halves of the splat data path apart (`render/splats.py`; gsplat's kernels on CUDA): the
owner's projection and SH colours of the view's Gaussians, forward and backward, and the reader's tile
intersection and rasterization of the splats, forward and backward; `--outside F` moves a share F of the
Gaussians out of the image (beside it, in front of the camera), which the projection still takes and culls: what
a view costs per Gaussian of the blocks it reads against per Gaussian in its image (the prediction's
`schedule.gpu_costs.CULLED_SHARE`).

The scene is meant to look like a training view: one camera, Gaussians spread through the frustum (depth 2-10,
about 5% outside the image), projected sizes log-uniform so a splat's 3-sigma footprint spans from a few
pixels to a few tens of pixels, mildly anisotropic with random rotations, opacities uniform in [0.1, 0.9],
SH degree 3 with DC colors in range, RGB render with a loss that touches every pixel.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import List, Optional, Sequence, Tuple

import torch

from .api import rasterization
from .cpu import rasterization_cpu

DEFAULT_SIZES = ("2000x128x128", "10000x256x256", "50000x256x256")
PROTOTYPE_S = {"2000x128x128": 0.08, "10000x256x256": 0.67, "50000x256x256": 2.6}


def make_scene(n: int, width: int, height: int, seed: int = 0, sh_degree: int = 3):
    g = torch.Generator().manual_seed(seed)
    f = 0.8 * width
    z = 2.0 + 8.0 * torch.rand(n, generator=g)
    x = (torch.rand(n, generator=g) * 2 - 1) * z * (width / 2 / f) * 1.05
    y = (torch.rand(n, generator=g) * 2 - 1) * z * (height / 2 / f) * 1.05
    means = torch.stack([x, y, z], 1)
    sigma_px = torch.exp(math.log(0.5) + torch.rand(n, generator=g) * math.log(10.0))  # 0.5 .. 5 px
    scales = (sigma_px * z / f)[:, None] * torch.exp(0.4 * (torch.rand(n, 3, generator=g) - 0.5) * 2)
    quats = torch.randn(n, 4, generator=g)
    opacities = 0.1 + 0.8 * torch.rand(n, generator=g)
    K = (sh_degree + 1) ** 2
    sh = torch.randn(n, K, 3, generator=g) * 0.1
    sh[:, 0] = (torch.rand(n, 3, generator=g) - 0.5) / 0.28209479177387814
    viewmats = torch.eye(4)[None]
    Ks = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])[None]
    target = torch.rand(1, height, width, 3, generator=g)
    return dict(means=means, quats=quats, scales=scales, opacities=opacities, colors=sh, viewmats=viewmats,
                Ks=Ks, width=width, height=height, sh_degree=sh_degree, target=target)


def _cpu_jiffies():
    """(busy jiffies of the whole machine, jiffies of this process); None where /proc is unavailable."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
        return sum(vals) - vals[3] - vals[4], int(mine[11]) + int(mine[12])
    except (OSError, ValueError, IndexError):
        return None


def _others_share(before, after, wall: float, threads: int) -> Optional[float]:
    """Fraction of `threads` cores that other processes used meanwhile (the machine may be shared)."""
    if before is None or after is None or wall <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / hz / (wall * max(1, threads)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd(scene, **kw) -> float:
    params = {k: scene[k].clone().requires_grad_() for k in ("means", "quats", "scales", "opacities", "colors")}
    _sync(params["means"].device)
    t0 = time.perf_counter()
    render = rasterization if params["means"].is_cuda else rasterization_cpu  # CPU-only options: --subtile, --batch
    rc, ra, meta = render(
        params["means"], params["quats"], params["scales"], params["opacities"], params["colors"],
        scene["viewmats"], scene["Ks"], scene["width"], scene["height"], sh_degree=scene["sh_degree"],
        packed=False, **kw,
    )
    meta["means2d"].retain_grad()
    loss = (rc - scene["target"]).abs().mean() + ra.mean()
    loss.backward()
    _sync(params["means"].device)
    return time.perf_counter() - t0


def moved_outside(scene, share: float):
    """The scene with its first `share` of Gaussians moved beside the image (x shifted by three image widths at
    their depth): in front of the camera, culled by the projection."""
    if share <= 0:
        return scene
    means = scene["means"].clone()
    k = int(share * means.shape[0])
    f = float(scene["Ks"][0, 0, 0])
    means[:k, 0] += 3.0 * scene["width"] / f * means[:k, 2]
    return dict(scene, means=means)


def halves(scene) -> Tuple[float, float, int]:
    """Seconds of the owner's half (projection and SH colours, forward and backward) and of the reader's (tile
    intersection and rasterization of those splats, forward and backward), and the splats in the image."""
    from .projection import RowCameras
    from .splats import project_splats, rasterize_splats

    device = scene["means"].device
    leaves = {"means": scene["means"], "quats": scene["quats"], "log_scales": scene["scales"].log(),
              "logits": torch.logit(scene["opacities"])[:, None], "coeffs": scene["colors"]}
    leaves = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    cams = RowCameras.one(scene["viewmats"][0], scene["Ks"][0], scene["width"], scene["height"])
    _sync(device)
    t0 = time.perf_counter()
    _, radii, splats = project_splats(leaves["means"], leaves["quats"], leaves["log_scales"], leaves["logits"],
                                      leaves["coeffs"], cams, scene["sh_degree"], antialiased=False)
    splats.backward(torch.ones_like(splats))
    _sync(device)
    t1 = time.perf_counter()
    received = splats.detach().requires_grad_()
    render, alpha, _ = rasterize_splats(received, radii, scene["width"], scene["height"])
    ((render - scene["target"]).abs().mean() + alpha.mean()).backward()
    _sync(device)
    return t1 - t0, time.perf_counter() - t1, int(radii.shape[0])


def main_halves(args, device) -> List[dict]:
    rows = []
    for size in args.sizes:
        n, w, h = (int(v) for v in size.split("x"))
        scene = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in moved_outside(make_scene(n, w, h), args.outside).items()}
        halves(scene)  # warm-up
        runs = [halves(scene) for _ in range(args.repeats)]
        owner, reader = (statistics.median(r[i] for r in runs) for i in (0, 1))
        rows.append(dict(size=size, n=n, width=w, height=h, outside=args.outside, visible=runs[0][2],
                         owner_s=owner, reader_s=reader))
    what = f"gsplat on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else \
        f"CPU, {args.threads} threads"
    print(f"odin_ns.render halves, {what}, forward+backward, median of {args.repeats}; {args.outside:.0%} of the "
          "Gaussians out of the image")
    for r in rows:
        share = r["owner_s"] / (r["owner_s"] + r["reader_s"])
        print(f"  {r['n']:,} Gaussians ({r['visible']:,} in the image), {r['width']}x{r['height']}: owner "
              f"{1000 * r['owner_s']:.2f} ms ({1e9 * r['owner_s'] / r['n']:.3f} ns a Gaussian), reader "
              f"{1000 * r['reader_s']:.2f} ms ({1e9 * r['reader_s'] / max(r['visible'], 1):.3f} ns a splat); "
              f"the owner's share {share:.2f}")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="NxWxH, e.g. 50000x256x256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--absgrad", action="store_true")
    ap.add_argument("--subtile", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per size")
    ap.add_argument("--device", default="cpu", help="cpu (the CPU rasterizer) or cuda (gsplat's kernels)")
    ap.add_argument("--halves", action="store_true", help="time the owner's and the reader's half apart")
    ap.add_argument("--outside", type=float, default=0.0, help="with --halves: share of Gaussians out of the image")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if args.halves:
        return main_halves(args, device)
    kw = {"absgrad": args.absgrad}
    if args.subtile:
        kw["subtile"] = args.subtile
    if args.batch:
        kw["batch"] = args.batch

    rows = []
    for size in args.sizes:
        n, w, h = (int(v) for v in size.split("x"))
        scene = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in make_scene(n, w, h).items()}
        fwd_bwd(scene, **kw)  # warm-up
        j0, t0 = _cpu_jiffies(), time.perf_counter()
        times = [fwd_bwd(scene, **kw) for _ in range(args.repeats)]
        others = _others_share(j0, _cpu_jiffies(), time.perf_counter() - t0, args.threads)
        med = statistics.median(times)
        rows.append(dict(size=size, n=n, width=w, height=h, median_s=med, min_s=min(times), max_s=max(times),
                         prototype_s=PROTOTYPE_S.get(size), others_cpu=others))
        if args.profile:
            from torch.profiler import profile

            with profile() as prof:
                fwd_bwd(scene, **kw)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    try:
        from rich.console import Console
        from rich.table import Table

        what = (f"gsplat on {torch.cuda.get_device_name(device)}" if device.type == "cuda"
                else f"CPU rasterizer, {args.threads} threads")
        table = Table(title=f"odin_ns.render {what}, forward+backward")
        cols = ("Gaussians", "image", "median s", "min s", "max s", "prototype s", "speed-up", "goal s",
                "others' CPU")
        for col in cols:
            table.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            proto = r["prototype_s"]
            table.add_row(
                f"{r['n']:,}", f"{r['width']}x{r['height']}", f"{r['median_s']:.3f}", f"{r['min_s']:.3f}",
                f"{r['max_s']:.3f}", f"{proto:.2f}" if proto else "-",
                f"{proto / r['median_s']:.1f}x" if proto else "-", f"{proto / 2:.3f}" if proto else "-",
                "-" if r["others_cpu"] is None else f"{100 * r['others_cpu']:.0f}%",
            )
        Console(width=140).print(table)
        if any((r["others_cpu"] or 0) > 0.1 for r in rows):
            print("note: other processes used the CPUs during the run; with OpenMP threads competing for cores,"
                  " times can be several times slower than on an idle machine")
    except ImportError:  # rich is a nerfstudio dependency; plain text otherwise
        for r in rows:
            print(r)
    return rows


if __name__ == "__main__":
    main()
