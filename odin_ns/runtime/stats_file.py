"""`odin_stats.json`: the machine-readable record of a run, written by rank 0 beside nerfstudio's outputs.

Per rank and step: views, compute time, wait time by cause, bytes moved, Gaussians owned and replicated
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


def summarize(records: List[dict], world_size: int, wall_s: float) -> Dict:
    steps = sorted({r["step"] for r in records})
    views = sum(len(r["views"]) for r in records)
    compute = sum(r["compute_s"] for r in records)
    waits = {c: sum(r["wait_s"][c] for r in records) for c in CAUSES}
    busy = compute + sum(waits.values())
    per_rank_compute = [sum(r["compute_s"] for r in records if r["rank"] == q) for q in range(world_size)]
    return {
        "ranks": world_size,
        "steps": len(steps),
        "views": views,
        "wall_s": wall_s,
        "views_per_s": views / wall_s if wall_s > 0 else None,
        "compute_s": compute,
        "wait_s": waits,
        "wait_share": {c: (w / busy if busy else 0.0) for c, w in waits.items()},
        "wait_share_total": (sum(waits.values()) / busy) if busy else 0.0,
        "no_wait_bound_s": max(per_rank_compute) if per_rank_compute else 0.0,
        "peak_gaussians_owned": [max((r["gaussians_owned"] for r in records if r["rank"] == q), default=0)
                                 for q in range(world_size)],
        "peak_gaussians_replicated": [max((r["gaussians_replicated"] for r in records if r["rank"] == q),
                                          default=0) for q in range(world_size)],
        "mean_gaussians_replicated": [_mean(r["gaussians_replicated"] for r in records if r["rank"] == q)
                                      for q in range(world_size)],
        "mean_blocks_read": _mean(r["blocks_read"] for r in records),
        "mean_blocks_total": _mean(r["blocks_total"] for r in records),
        "bytes_sent": sum(r["bytes_sent"] for r in records),
        "read_set_misses": sum(r.get("read_set_misses", 0) for r in records),
    }


def write_stats(log: WaitLog, world_size: int, wall_s: float, out_dir: Path, meta: Dict) -> Optional[Path]:
    """Collect every rank's records on rank 0 (collective when distributed) and write odin_stats.json there."""
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
