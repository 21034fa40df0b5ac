"""Per-view costs for the schedule and its simulator: a model of the renderer, or what an earlier run measured.

The model: rendering a view costs a fixed part plus a part per Gaussian it reads plus a part per pixel (the
CPU renderer's forward + backward, fitted on the built-in city and the fox photos on a 2-core machine; a GPU
changes the constants, not the ordering the schedule cares about). `--costs odin_stats.json` replaces the model
by what that run measured: at every step where the replayed rank renders the views the run's rank rendered, that
step's own render, update and bookkeeping times (the run's step-to-step jitter, which is what ranks wait for);
elsewhere the mean measured render time of each view and the mean update, bookkeeping and phase boundary
costs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Sequence, Tuple

from odin_ns.errors import OdinInputError
from odin_ns.schedule.simulate import Costs

RENDER_FIXED_S = 0.004
RENDER_PER_GAUSSIAN_S = 4.0e-6
RENDER_PER_PIXEL_S = 1.0e-6
MESSAGE_LATENCY_S = 0.0003  # gloo p2p on one host (DESIGN.md)


def model_costs(gaussians: Sequence[float], pixels: Sequence[float]) -> Costs:
    """Costs from the model for views with `gaussians[v]` Gaussians read and `pixels[v]` pixels."""
    per_view = [RENDER_FIXED_S + RENDER_PER_GAUSSIAN_S * g + RENDER_PER_PIXEL_S * p
                for g, p in zip(gaussians, pixels)]
    return Costs(render=lambda v: per_view[v], update=0.002, latency=MESSAGE_LATENCY_S, phase=0.02,
                 overhead=0.004)


def costs_from_stats(path: Path, num_views: int) -> Costs:
    """Costs measured by the run that wrote `path` (an odin_stats.json): per view, the mean render time of its
    renders; views it never rendered get the mean of those it did."""
    try:
        data = json.loads(Path(path).read_text())
        steps = data["steps"]
        data["summary"]["phases"]  # noqa: B018 (a stats file has a summary with phases)
    except FileNotFoundError:
        raise OdinInputError(f"--costs {path}: no such file (give the odin_stats.json of an earlier run)") from None
    except (ValueError, KeyError, TypeError):
        raise OdinInputError(f"--costs {path}: not an odin_stats.json (it has no per-step stats; give the "
                             "odin_stats.json an odin run writes next to its config)") from None
    if not steps:
        raise OdinInputError(f"--costs {path}: the stats file has no steps")
    totals: Dict[int, list] = {}
    update, overhead = [], []
    per_step: Dict[Tuple[int, int], Tuple[Tuple[int, ...], float, float, float]] = {}
    for rec in steps:
        # throughput-first's owners update on the communication lane: that time is the step's update too
        rec_update = rec["update_s"] + (rec.get("background_s") or {}).get("update", 0.0)
        if "step" in rec and "rank" in rec:
            per_step[(int(rec["step"]), int(rec["rank"]))] = (
                tuple(int(v) for v in rec.get("views") or ()), rec["compute_s"], rec_update,
                rec.get("bookkeeping_s", 0.0) + rec.get("loop_s", 0.0))
        views = rec.get("views") or []
        for v in views:
            t = totals.setdefault(int(v), [0.0, 0])
            t[0] += rec["compute_s"] / len(views)
            t[1] += 1
        update.append(rec_update)
        overhead.append(rec.get("bookkeeping_s", 0.0) + rec.get("loop_s", 0.0))
    if max(totals, default=-1) >= num_views:
        raise OdinInputError(f"--costs {path}: the run it measured rendered view {max(totals)}, this data has "
                             f"only {num_views} training views (give the stats of a run on the same data)")
    means = {v: s / n for v, (s, n) in totals.items()}
    fallback = sum(means.values()) / len(means)
    per_view = [means.get(v, fallback) for v in range(num_views)]
    summary = data["summary"]
    phases = max(int(summary.get("phases", 1)), 1)
    ranks = max(int(summary.get("ranks", 1)), 1)
    phase = summary.get("wait_s", {}).get("phase", 0.0) / ranks / phases
    return Costs(render=lambda v: per_view[v], update=sum(update) / len(update), latency=MESSAGE_LATENCY_S,
                 phase=phase, overhead=sum(overhead) / len(overhead),
                 measured=lambda step, rank: per_step.get((step, rank)))
