"""`odin_stats.json`: the machine-readable record of a run, written by rank 0 beside nerfstudio's outputs.

Per rank and step: views, compute time, wait time by cause, bytes moved, Gaussians and bytes held
(`runtime.waits.StepRecord`), plus a summary (views/s, wait share by cause, peak Gaussians per rank).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional

import torch.distributed as dist

from odin_ns.runtime.waits import CAUSES, WaitLog


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _rank_max(records: List[dict], key: str, world_size: int) -> List:
    """Each rank's largest `key` over its records (0 where a record lacks it or the rank has none)."""
    return [max((r.get(key, 0) for r in records if r["rank"] == q), default=0) for q in range(world_size)]


def _train_wall(records: List[dict]) -> float:
    """From the first step's start to the last step's end, on the rank that finished last (the training loop)."""
    if not records:
        return 0.0
    first = min(r["started"] for r in records)
    last = max(r["started"] + r["wall_s"] for r in records)
    return last - first


def summarize(records: List[dict], world_size: int, wall_s: float) -> Dict:
    """Totals of a run. `train_wall_s` is the training loop's wall; per rank, render + update + bookkeeping +
    loop + waits add up to that rank's share of it (its steps' walls)."""
    steps = sorted({r["step"] for r in records})
    views = sum(len(r["views"]) for r in records)
    compute = sum(r["compute_s"] for r in records)
    waits = {c: sum(r["wait_s"][c] for r in records) for c in CAUSES}
    busy = compute + sum(waits.values())
    per_rank = []
    for q in range(world_size):
        mine = [r for r in records if r["rank"] == q]
        per_rank.append({
            "render_s": sum(r["compute_s"] for r in mine),
            "update_s": sum(r.get("update_s", 0.0) for r in mine),
            # throughput-first updates run beside the render (not part of the wall's sum, but the rank's work)
            "background_update_s": sum(r.get("background_s", {}).get("update", 0.0) for r in mine),
            "bookkeeping_s": sum(r.get("bookkeeping_s", 0.0) for r in mine),
            "loop_s": sum(r.get("loop_s", 0.0) for r in mine),
            "wait_s": {c: sum(r["wait_s"][c] for r in mine) for c in CAUSES},
            "wall_s": sum(r.get("wall_s", 0.0) for r in mine),
            "cpu_s": sum(r.get("cpu_s", 0.0) for r in mine),
        })
    train_wall = _train_wall(records)
    return {
        "ranks": world_size,
        "steps": len(steps),
        "views": views,
        "wall_s": wall_s,
        "train_wall_s": train_wall,
        "views_per_s": views / train_wall if train_wall > 0 else None,
        "compute_s": compute,
        "wait_s": waits,
        "wait_share": {c: (w / busy if busy else 0.0) for c, w in waits.items()},
        "wait_share_total": (sum(waits.values()) / busy) if busy else 0.0,
        "per_rank": per_rank,
        "no_wait_bound_s": max((p["render_s"] + p["update_s"] + p["background_update_s"] for p in per_rank),
                               default=0.0),
        "peak_gaussians_owned": _rank_max(records, "gaussians_owned", world_size),
        "peak_resident_share": resident_share(records, world_size),
        "peak_bytes_per_rank": _rank_max(records, "resident_bytes", world_size),
        "peak_bytes_share": bytes_share(records, world_size),
        # the most message bytes (sends, receives, gradients) a rank held at once (`runtime.held_bytes`)
        "peak_message_bytes_per_rank": _rank_max(records, "message_bytes", world_size),
        "peak_projection_bytes_per_rank": _rank_max(records, "projection_bytes", world_size),
        "projections_kept": sum(r.get("projections_kept", 0) for r in records),
        "projections_again": sum(r.get("projections_again", 0) for r in records),
        "eval_renders": sum(r.get("eval_renders", 0) for r in records),
        "mean_blocks_read": _mean(r["blocks_read"] for r in records),
        "mean_blocks_total": _mean(r["blocks_total"] for r in records),
        "bytes_sent": sum(r["bytes_sent"] for r in records),
        "bytes_per_step": sum(r["bytes_sent"] for r in records) / len(steps) if steps else 0.0,
        **bytes_per_pair(records),
        "read_set_misses": sum(r.get("read_set_misses", 0) for r in records),
        "misses_handled": sum(r.get("misses_handled", 0) for r in records),
        "receives": sum(r.get("receives", 0) for r in records),
        "receives_ahead": sum(r.get("receives_ahead", 0) for r in records),
        "plan_violations": sum(r.get("plan_violations", 0) for r in records),
        "phases": sum(1 for r in records if r.get("phase_start") and r["rank"] == 0),
        "runtime_ops_per_step": _mean(r["runtime_ops"] for r in records if r.get("runtime_ops") is not None),
        "runtime_syncs_per_step": _mean(r["runtime_syncs"] for r in records if r.get("runtime_syncs") is not None),
        **stale_summary(records),
    }


def bytes_per_pair(records: List[dict]) -> Dict[str, float | None]:
    """Bytes moved per visible (view, remote Gaussian) pair the views rendered: to the readers (publications:
    rows or splats, headers included) and back to the owners (gradients)."""
    pairs = sum(r.get("remote_pairs", 0) for r in records)

    def per(kind):
        return sum(r.get("bytes_by_kind", {}).get(kind, 0) for r in records) / pairs if pairs else None

    return {"remote_pairs": pairs, "bytes_per_pair_to_reader": per("P"), "bytes_per_pair_back": per("G")}


def model_rows(records: List[dict]) -> Dict[int, int]:
    """The whole model's rows at each step: every rank's owned rows."""
    model: Dict[int, int] = {}
    for r in records:
        model[r["step"]] = model.get(r["step"], 0) + r["gaussians_owned"]
    return model


def bytes_share(records: List[dict], world_size: int) -> List[float]:
    """Per rank, the largest ratio over its steps of the bytes it held (`resident_bytes`) to what one process
    training the same model holds at that step: every row's parameters with Adam's two moments."""
    model = model_rows(records)
    return [max((r["resident_bytes"] / (3 * r["row_bytes"] * model[r["step"]]) for r in records
                 if r["rank"] == q and model.get(r["step"]) and r.get("row_bytes")), default=0.0)
            for q in range(world_size)]


def resident_share(records: List[dict], world_size: int) -> List[float]:
    """Per rank, the largest share of the model (all ranks' owned rows at that step) it held at a step: its owned
    rows (no rank holds another's)."""
    model = model_rows(records)
    return [max((r["gaussians_owned"] / model[r["step"]] for r in records
                 if r["rank"] == q and model.get(r["step"])), default=0.0) for q in range(world_size)]


def stale_summary(records: List[dict]) -> Dict:
    """Throughput-first: block reads admitted behind and refused, the largest staleness, the updates skipped."""
    reads = [e for r in records for e in r.get("stale_reads", [])]
    admitted = sum(e["blocks"] for e in reads)
    refused = sum(r.get("stale_refused", 0) for r in records)
    skipped = [e["skipped"] for e in reads]
    return {"stale_admitted": admitted, "stale_refused": refused,
            "stale_admitted_share": admitted / (admitted + refused) if admitted + refused else 0.0,
            "max_staleness_seen": max((e["staleness"] for e in reads), default=0),
            "mean_skipped_update": _mean(skipped), "max_skipped_update": max(skipped, default=0.0)}


def write_stats(log: WaitLog, world_size: int, wall_s: float, out_dir: Path, meta: Dict) -> Optional[Path]:
    """Collect every rank's records on rank 0 (collective when distributed) and write odin_stats.json there."""
    log.close()
    mine = [r.to_dict() for r in log.records]
    if world_size > 1:
        everyone: List[Optional[list]] = [None] * world_size
        dist.all_gather_object(everyone, mine)
        if log.rank != 0:
            return None
        records = [r for part in everyone for r in (part or [])]
    else:
        records = mine
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "odin_stats.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summarize(records, world_size, wall_s),
                               "steps": records}))
    os.replace(tmp, path)
    return path
