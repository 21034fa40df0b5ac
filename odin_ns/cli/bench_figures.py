"""The pictures of `odin-bench train`: a per-rank timeline of a window of steps for each run, and bars of
speed-up and wait hidden beside the ideal. Drawn with matplotlib from the runs' odin_stats.json records."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the non-interactive backend)
from matplotlib.patches import Patch  # noqa: E402

COLORS = {"render": "#4c72b0", "update": "#55a868", "validate": "#c44e52", "transfer": "#dd8452",
          "barrier": "#8172b3", "phase": "#937860", "gather": "#da8bc3", "bookkeeping": "#d0d0d0"}


def timeline(runs: List[Dict], path: Path, first_step: int, num_steps: int) -> Path:
    """One panel per run; per rank, each step's wall as a grey bar (bookkeeping and loop) with its render, update
    and wait segments drawn over it."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.2 + 1.1 * len(runs) * max(1, runs[0]["ranks"]) / 2),
                             squeeze=False, sharex=True)
    for ax, run in zip(axes[:, 0], runs):
        records = [r for r in run["records"] if first_step <= r["step"] < first_step + num_steps]
        if not records:
            continue
        t0 = min(r["started"] for r in records)
        for r in records:
            y = r["rank"]
            ax.barh(y, r["wall_s"], left=r["started"] - t0, height=0.8, color=COLORS["bookkeeping"],
                    edgecolor="white", linewidth=0.5)
            for kind, offset, duration in r.get("segments", []):
                ax.barh(y, duration, left=r["started"] - t0 + offset, height=0.6, color=COLORS.get(kind, "black"))
        ax.set_yticks(range(run["ranks"]))
        ax.set_yticklabels([f"rank {q}" for q in range(run["ranks"])])
        ax.invert_yaxis()
        ax.set_title(f"{run['label']}: steps {first_step}-{first_step + num_steps - 1}", fontsize=9, loc="left")
        ax.set_xlabel("seconds")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="lower center", ncol=8,
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _or_zero(value) -> float:
    """A figure that is not defined for a run (None or nan) draws no bar."""
    return 0.0 if value is None or value != value else float(value)


def bars(rows: List[Dict], ideal_speedup: float, path: Path, title: str) -> Path:
    """Speed-up over barrier (same schedule) and wait hidden per run, the ideal speed-up as a line."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    a.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], width=0.4, color="#4c72b0", label="measured")
    a.bar([i + 0.2 for i in x], [_or_zero(r.get("speedup_equal_speed")) for r in rows], width=0.4,
          color="#8172b2", label="at equal compute speed")
    a.axhline(ideal_speedup, color="#c44e52", linestyle="--", label=f"ideal {ideal_speedup:.2f}x")
    a.axhline(1.0, color="black", linewidth=0.8)
    a.set_ylabel("speed-up over odin-barrier")
    a.legend(fontsize=8)
    b.bar([i - 0.2 for i in x], [100 * r["wait_hidden"] for r in rows], width=0.4, color="#55a868",
          label="measured")
    b.bar([i + 0.2 for i in x], [100 * _or_zero(r.get("wait_hidden_equal_speed")) for r in rows],
          width=0.4, color="#937860", label="at equal compute speed")
    b.legend(fontsize=8)
    b.axhline(0, color="black", linewidth=0.8)
    b.set_ylabel("barrier wait hidden (%)")
    for ax in (a, b):
        ax.set_xticks(x, labels)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
