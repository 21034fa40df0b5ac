"""Per-view and per-update costs of a GPU, for the prediction at rank counts this machine cannot run.

A view's render (forward, loss, backward) costs  a + b * G + c * P  seconds, P its pixels and G its Gaussians:
for a model calibrated on whole scenes (`published`: per Gaussian of the model), the Gaussians of the blocks the
view reads; for one calibrated on a view that sees nearly every Gaussian it renders (`h200`: the renderer's
benchmark, 94% in the image: `H200_BENCH_SEEN`), the Gaussians of those blocks in the view's image, and a share
(`CULLED_SHARE`) of a Gaussian's cost for each of the others: gsplat's projection computes a Gaussian's 2-D
footprint before it culls one outside the image, and colours, intersects, rasterizes and back-propagates only the
splats in it (on the CPU the render time of a view follows the Gaussians in its image, correlation 0.94, more than
those it reads, 0.71, and a culled Gaussian costs 0.3% of one in view: `python -m odin_ns.render.bench --halves
--outside 0.5`, which measures the same on a GPU). An owner's update of a step costs  u0 + u1 * T,  T the rows
of its blocks that the step's views read (selective Adam on touched rows); every step adds the runtime's own
launches (about 115-165 tensor operations and 2 host syncs per step by policy, `odin-bench scale`: ~1 ms); a phase
boundary ~2 ms (a few small collectives), and at each phase start a rank's planning as this machine times it with
the read sets' all-gather on the link (`schedule.planning_time`).

Two calibrations:
- published (default): gsplat's own 30k-step training times on Mip-NeRF 360 (gsplat docs, tests/eval: TITAN
  RTX, 7 scenes, 1.2-6.3M Gaussians, 1.0-1.6 Mpx): per iteration 42.6 ms + 8.94 ns per Gaussian fits all seven
  within 16% (bonsai 47.4 ms at 1.25M ... garden 100.4 ms at 5.84M). Of the per-Gaussian part, the update of every
  row is taken out (3.3 ns a row: Adam's bandwidth on that GPU, 672 GB/s, from the H200's measured 0.47 ns a row
  at 4.8 TB/s) and charged to the owners instead, and so are the update's launches and the step's own (0.8 + 1
  ms of the 42.6). The published times do not separate a per-pixel part (the indoor scenes, 1.6 Mpx, train no
  slower per Gaussian than the outdoor ones at 1.0-1.1 Mpx), so the fixed part stays fixed. One such GPU alone
  then costs what gsplat published for the same scene.
- h200: measured on one H200 (README, `python -m odin_ns.render.bench --device cuda`): render 0.5 ms + 1.38 ns a
  Gaussian + 2.04 ns a pixel; update 0.8 ms (six parameters' launches) + 0.47 ns a row (fused Adam's rate; the
  project's unfused selective Adam measured 4.1 ns a row there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from odin_ns.runtime.projection_memory import GRAPH_ROW_BYTES
from odin_ns.schedule.actions import Action
from odin_ns.schedule.links import Link
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.simulate import Costs
from odin_ns.schedule.visibility import view_gaussians

PARAM_BYTES = 4 * 59  # a publication's row: the six parameters at SH degree 3, float32
GRAD_BYTES = 4 * (59 + 3)  # a gradient row: the parameters' gradients and the densification statistics
# the splat data path (DESIGN.md "The data path: splats, not rows"; gsplat's rasterization(distributed=True)): per
# (view, Gaussian) pair the owner sends the projected splat (2-D mean, depth, conic, opacity, RGB colour, radius;
# the reader knows each splat's place from a count per block in the header, which this leaves out)
# and gets back the gradients of what the rasterizer differentiates (2-D mean, conic, opacity, colour) with the
# statistic splatfacto's densification takes of the absolute screen-space gradient, their scaled norm (as
# runtime/splat_path.py sends them)
SPLAT_BYTES = 4 * (2 + 1 + 3 + 1 + 3 + 1)
SPLAT_GRAD_BYTES = 4 * (2 + 3 + 1 + 3 + 1)
DATA_PATHS = ("rows", "splats")
# A projection made again (`--pipeline.projection-memory recompute`, and auto beyond its budget) projects an
# owner's rows for its readers a second time at its update, with a graph: priced at a tenth of a Gaussian's render
# per projected (view, Gaussian) pair. An estimate, not measured here: fvdb-reality-capture's published garden benchmark projects in 0.46 ms of a
# 1.84 ms forward render, and a backward costs about twice a forward.
RECOMPUTE_SHARE = 0.1
# A Gaussian of the blocks a view reads that is out of its image, as a share of one in it: its projection's
# forward, as above (the kernel computes its footprint, then culls it; no colour, no backward). An estimate, not
# measured here (no GPU).
CULLED_SHARE = RECOMPUTE_SHARE


def rendered_gaussians(gpu: "GpuModel", gaussians_read: Sequence[float], counts: Sequence[int],
                       visible: Optional[torch.Tensor]) -> List[float]:
    """Per view, the Gaussians its render is priced by (the module docstring): those of the blocks it reads, or, for
    a model calibrated in view and where the blocks' shares in each view's image (`visible` [views, blocks]) are
    known, those in its image and `CULLED_SHARE` of each of the others."""
    if not gpu.in_view or visible is None:
        return [float(g) for g in gaussians_read]
    seen = view_gaussians(visible, counts)
    return [min(s, float(g)) + CULLED_SHARE * max(float(g) - s, 0.0) for g, s in zip(gaussians_read, seen)]


def pair_rows(plan: PhasePlan, step: int, count: torch.Tensor) -> torch.Tensor:
    """[pairs, ranks] float64: for each view of `step` (rank, then view), the rows of each rank's blocks it reads,
    `count` per block: what each owner projects for it."""
    owner = torch.as_tensor(plan.owner)
    views = [blocks for r in range(plan.num_ranks) for blocks in plan.view_reads(step, r)]
    out = torch.zeros((len(views), plan.num_ranks), dtype=torch.float64)
    for k, blocks in enumerate(views):
        out[k].index_add_(0, owner[list(blocks)], count[list(blocks)].double())
    return out


@dataclass(frozen=True)
class GpuModel:
    name: str
    render_fixed_s: float
    render_per_gaussian_s: float
    render_per_pixel_s: float
    update_fixed_s: float
    update_per_row_s: float
    step_overhead_s: float = 1e-3
    phase_s: float = 2e-3
    source: str = ""
    in_view: bool = False  # calibrated on Gaussians in the image: a view's render prices those (module docstring)
    memory_bytes: float = 24 * 2 ** 30  # one GPU's memory (--pipeline.projection-memory auto's budget is a share)


# The H200's 1.38 ns were per Gaussian of the renderer's benchmark scene at 1297x840, 93.6% of whose Gaussians are
# in the image (counted by its projection at 200k and 1M): per Gaussian in view, priced as `rendered_gaussians` does
H200_BENCH_SEEN = 0.936 + CULLED_SHARE * (1 - 0.936)

GPUS: Dict[str, GpuModel] = {m.name: m for m in (
    GpuModel("published", 40.8e-3, 5.64e-9, 0.0, 0.8e-3, 3.3e-9,
             source="gsplat's 30k-step Mip-NeRF 360 times (TITAN RTX, 24 GB): 42.6 ms + 8.94 ns/Gaussian per "
                    "iteration"),
    GpuModel("h200", 0.5e-3, 1.38e-9 / H200_BENCH_SEEN, 2.04e-9, 0.8e-3, 0.47e-9, in_view=True,
             memory_bytes=139 * 2 ** 30,
             source="measured on one H200: gsplat forward+backward and fused Adam"),
)}


def gpu_costs(plans: Sequence[PhasePlan], gaussians_read: Sequence[float], pixels: Sequence[float],
              counts: Sequence[int], scale: float, gpu: GpuModel, link: Link,
              visible: Optional[torch.Tensor] = None, data_path: str = "rows",
              stale_plans: Optional[Sequence[PhasePlan]] = None, keep_budget: float = 0.0,
              planning_s: Sequence[float] = (), gather_bytes: Sequence[float] = ()) -> Costs:
    """Costs of these plans' steps on `gpu` GPUs joined by `link`, every block's Gaussians times `scale` (the
    plan's points standing for a scene of that many more Gaussians). Messages: a reader's gradients carry the
    rows of the owner's blocks its views see (a G per view: each view its share of the rank's rows of a block, by
    its pairs), a publication the rows of the blocks the update touched (some view of the step sees them), from
    `visible` (share of a block's rows in a view); without it, whole blocks (a bound). The update's rows are the
    same touched rows. A view's render is priced by `rendered_gaussians` (with `visible`, for a model calibrated in
    view, by the Gaussians in its image).

    data_path "splats" prices the messages of the splat data path instead (what the runtime moves): an owner's
    publication of update u to a reader carries one splat per (view, Gaussian) pair of the reader's views that see
    the owner's blocks at every step whose read takes version u (step u+1's current reads, and at throughput-first
    the later steps' reads the lists admit behind at u), every step (splats are per view: nothing stays at the
    reader), and a view's gradient message one splat gradient per pair of the view; the renders' costs are the
    same (the projection moves from the reader to the owner, the total does not change) and an owner's update adds
    the projection made again at it (`RECOMPUTE_SHARE` of a render per projected pair: whole blocks, every view
    that reads them) at the steps where the graphs of its step's projections (`GRAPH_ROW_BYTES` a projected row)
    would hold more than `keep_budget` bytes (`--pipeline.projection-memory`: 0 recompute, inf keep, auto a share
    of the GPU's memory; the runtime decides projection by projection, with those in flight). `stale_plans`: the
    same phases under throughput-first, whose lists say which reads its lane's publications carry (without:
    current reads). `planning_s` and `gather_bytes` (per phase, `schedule.planning_time`): a rank's planning at
    each phase start, as timed, and the read sets it receives in the all-gather, a ring on `link` (every rank
    receives the others' parts one after another)."""
    if data_path not in DATA_PATHS:
        raise ValueError(f"unknown data path {data_path!r} (choose from {', '.join(DATA_PATHS)})")
    count = torch.as_tensor(counts, dtype=torch.float64)
    share = visible.double() if visible is not None else None
    touched_rows: Dict[int, torch.Tensor] = {}  # step -> [blocks] rows some view of the step sees
    # (step, rank) -> [blocks] rows its views see, each once (the rows' gradient messages)
    seen_rows: Dict[Tuple[int, int], torch.Tensor] = {}
    # (step, rank, slot) -> [blocks] the (view, Gaussian) pairs of the rank's view in that slot (a G per view)
    view_pairs: Dict[Tuple[int, int, int], torch.Tensor] = {}
    n_views: Dict[Tuple[int, int], int] = {}  # (step, rank) -> its views
    render = [gpu.render_fixed_s + gpu.render_per_gaussian_s * scale * g + gpu.render_per_pixel_s * p
              for g, p in zip(rendered_gaussians(gpu, gaussians_read, counts, visible), pixels)]
    per_step: Dict[Tuple[int, int], Tuple[Tuple[int, ...], float, float, float]] = {}
    owner_at: Dict[int, torch.Tensor] = {}  # step -> [blocks] owning rank (the splat path's publications)
    read_at: Dict[Tuple[int, int, int], int] = {}  # (step, reader, owner) -> the version its read takes (lists)
    window: Dict[int, range] = {}  # update -> the steps its publication serves
    for plan in stale_plans if data_path == "splats" and stale_plans else ():
        for r in range(plan.num_ranks):
            for a in plan.actions(r):
                if a.kind == "W" and a.peer != r:
                    read_at[(a.step, r, a.peer)] = a.step - 1 - a.stale
        for u in range(plan.start - 1, plan.stop - 1):
            window[u] = plan.window(u)
    for plan in plans:
        owner = torch.as_tensor(plan.owner)
        for step in range(plan.start, plan.stop):
            owner_at[step] = owner
            n_views.update(((step, r), len(plan.rank_views(step, r))) for r in range(plan.num_ranks))
            if share is None:  # every Gaussian of a block a view reads, in each view
                for r in range(plan.num_ranks):
                    for j, blocks in enumerate(plan.view_reads(step, r)):
                        view_pairs[(step, r, j)] = count * torch.zeros(len(counts), dtype=torch.float64).index_fill_(
                            0, torch.as_tensor(list(blocks), dtype=torch.int64), 1.0)
            mask = torch.zeros(len(counts), dtype=torch.float64)
            mask[list(plan.touched(step))] = 1.0
            if share is None:
                touched_rows[step] = count * mask
            else:
                views = [v for r in range(plan.num_ranks) for v in plan.rank_views(step, r)]
                touched_rows[step] = count * mask * (1 - torch.prod(1 - share[views], dim=0))
                for r in range(plan.num_ranks):
                    for j, v in enumerate(plan.rank_views(step, r)):
                        view_pairs[(step, r, j)] = count * share[v]
                    pairs = count * share[list(plan.rank_views(step, r))].sum(dim=0)  # (view, Gaussian) pairs
                    seen_rows[(step, r)] = pairs.clamp(max=count)
            projected = pair_rows(plan, step, count).sum(0) if data_path == "splats" else \
                torch.zeros(plan.num_ranks, dtype=torch.float64)  # per owner, the pairs it projects
            projected = projected * (GRAPH_ROW_BYTES * scale * projected > keep_budget)  # made again at U
            for r in range(plan.num_ranks):
                views = tuple(plan.rank_views(step, r))
                rows = scale * float(touched_rows[step][owner == r].sum())
                update = gpu.update_fixed_s + gpu.update_per_row_s * rows + \
                    RECOMPUTE_SHARE * gpu.render_per_gaussian_s * scale * float(projected[r])
                per_step[(step, r)] = (views, sum(render[v] for v in views), update, gpu.step_overhead_s)

    def message_bytes(sender: int, a: Action) -> float:
        blocks = list(a.blocks)
        if a.kind == "G":  # one view's: its pairs of the blocks (rows: its share of the rank's rows of each block)
            pairs = view_pairs[(a.step, sender, a.slot)][blocks]
            if data_path == "splats":
                return scale * float(pairs.sum()) * SPLAT_GRAD_BYTES
            rank_rows = seen_rows[(a.step, sender)][blocks] if (a.step, sender) in seen_rows else count[blocks]
            rank_pairs = sum(view_pairs[(a.step, sender, j)][blocks] for j in range(n_views[(a.step, sender)]))
            share_of = torch.where(rank_pairs > 0, pairs / rank_pairs.clamp(min=1e-300), torch.zeros_like(pairs))
            return scale * float((rank_rows * share_of).sum()) * GRAD_BYTES
        if data_path == "splats":
            return sum(size for _, _, size in message_parts(sender, a))
        rows = touched_rows[a.step][blocks] if a.step in touched_rows else count[blocks]  # phase start: whole
        return scale * float(rows.sum()) * PARAM_BYTES

    def message_parts(sender: int, a: Action) -> Optional[List[Tuple[int, int, float]]]:
        """A publication of splats: one payload per view of the reader whose read of the owner takes this version
        (step, slot, bytes); rows travel as one payload (None)."""
        if a.kind != "P" or data_path != "splats":
            return None
        steps = [t for t in window.get(a.step, ()) if read_at.get((t, a.peer, sender)) == a.step] \
            if a.on_thread else [a.step + 1]  # the lane's lists (reads behind), or the exact ones
        return [(t, j, scale * SPLAT_BYTES * float(view_pairs[(t, a.peer, j)][owner_at[t] == sender].sum()))
                for t in steps if t in owner_at for j in range(n_views[(t, a.peer)])]

    mean_update = sum(u for _, _, u, _ in per_step.values()) / max(len(per_step), 1)
    ranks = plans[0].num_ranks if plans else 1
    phase_start = [p + ((ranks - 1) * link.latency_s + b / link.bandwidth if ranks > 1 else 0.0)
                   for p, b in zip(planning_s, gather_bytes, strict=True)]
    return Costs(render=lambda v: render[v], update=mean_update, latency=link.latency_s, phase=gpu.phase_s,
                 phase_start=phase_start, overhead=gpu.step_overhead_s, bandwidth=link.bandwidth,
                 message_bytes=message_bytes, message_parts=message_parts, shared_compute=True,
                 measured=lambda step, rank: per_step.get((step, rank)))


def single_gpu_iteration_s(gpu: GpuModel, gaussians: float, pixels: float) -> float:
    """One GPU alone, one view per step, every Gaussian in view and updated: the model's per-iteration time (what
    the published calibration reproduces)."""
    return (gpu.render_fixed_s + gpu.render_per_gaussian_s * gaussians + gpu.render_per_pixel_s * pixels
            + gpu.update_fixed_s + gpu.update_per_row_s * gaussians + gpu.step_overhead_s)


def describe(gpu: GpuModel, link: Link, reference: Optional[Tuple[float, float]] = (5.84e6, 1297 * 840)) -> str:
    priced = "the Gaussians in its image" if gpu.in_view else "the Gaussians of the blocks it reads"
    line = f"GPU model {gpu.name} ({gpu.source}; a view's render priced by {priced}); link {link.name} ({link.source})"
    if reference:
        line += (f"; one GPU alone at {reference[0] / 1e6:.2f}M Gaussians, {reference[1] / 1e6:.2f} Mpx, every "
                 "Gaussian in view: "
                 f"{1000 * single_gpu_iteration_s(gpu, *reference):.1f} ms per iteration")
    return line
