"""The viewer's Odin panel during distributed training: how the model is distributed and who waits on whom.

nerfstudio's viewer installs every `ViewerElement` it finds on the pipeline (and on its nn.Module attributes)
under "Custom Elements"; the panel is such a module, so the elements appear in a folder named after it, "Odin":
- a toggle that colours every Gaussian by its owning rank (the model draws its snapshot in owner colours);
- the policy, the current phase, the stale reads admitted so far (throughput-first);
- per rank, the share of the last refresh window's wall spent rendering, updating and waiting, as text and as a
  stacked bar chart (plotly, which viser draws); throughput-first's owners update on a thread beside the render,
  and that thread's busy share is shown after the rank's own (it overlaps the render, so a bar may pass 100%).
Rank 0 fills it at every viewer refresh from a small all-gather of each rank's window (`window_shares`).
Written by hand where nerfstudio has no element: the plot (`ViewerPlotly`, viser's plotly element).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from nerfstudio.viewer.viewer_elements import ViewerCheckbox, ViewerElement, ViewerText

from odin_ns.schedule.policies import POLICIES

PARTS = ("render", "update", "wait", "update thread")
COLOURS = {"render": "#4c72b0", "update": "#55a868", "wait": "#c44e52", "update thread": "#a6d8b0"}


def window_shares(records: List[dict]) -> Dict[str, float]:
    """Shares of the wall of a window of step records (`StepRecord.to_dict`) spent rendering, updating and
    waiting (all causes) on the rank's own thread, and updating on the update thread beside it (throughput-first),
    with the wall itself and the stale block reads admitted in it."""
    wall = sum(r["wall_s"] for r in records)
    seconds = {"render": sum(r["compute_s"] for r in records), "update": sum(r["update_s"] for r in records),
               "wait": sum(sum(r["wait_s"].values()) for r in records),
               "update thread": sum(r["background_s"]["update"] for r in records)}
    return {**{part: s / wall if wall > 0 else 0.0 for part, s in seconds.items()}, "wall_s": wall,
            "steps": len(records), "stale_admitted": sum(e["blocks"] for r in records for e in r["stale_reads"])}


def describe(shares: Dict[str, float]) -> str:
    beside = f" (+{shares['update thread']:.0%} on the update thread)" if shares["update thread"] > 0 else ""
    # render and wait first: the panel's field shows the first 25 characters or so
    return (f"render {shares['render']:.0%}, wait {shares['wait']:.0%}, update {shares['update']:.0%}{beside} "
            f"of {shares['wall_s']:.1f} s over {shares['steps']} steps")


def bar_chart(shares_by_rank: List[Dict[str, float]]):
    """A stacked horizontal bar per rank: render, update, wait, then the update thread's share (of the window's
    wall), with a one-line legend above the bars, small beside them in the viewer's narrow panel."""
    import plotly.graph_objects as go

    ranks = [f"rank {r}" for r in range(len(shares_by_rank))]
    parts = [p for p in PARTS if p != "update thread" or any(s[p] > 0 for s in shares_by_rank)]
    fig = go.Figure([go.Bar(name=part, y=ranks, x=[100 * s[part] for s in shares_by_rank], orientation="h",
                            marker_color=COLOURS[part]) for part in parts])
    longest = max([100.0] + [100 * sum(s[p] for p in parts) for s in shares_by_rank])
    fig.update_layout(barmode="stack", height=70 + 24 * len(ranks), margin=dict(l=4, r=4, t=22, b=4),
                      xaxis=dict(range=[0, longest], ticksuffix="%", tickfont=dict(size=10)),
                      yaxis=dict(autorange="reversed", tickfont=dict(size=10)),
                      legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=10),
                                  itemwidth=30, traceorder="normal"))
    return fig


PANEL_WIDTH = 260  # about the pixels the viewer's control panel gives a plot


class ViewerPlotly(ViewerElement[None]):
    """A plotly figure in the viewer (viser's `add_plotly`; nerfstudio has no such element). viser's client makes
    the plot as high as its width times `aspect`, whatever the figure's own height says: the aspect is taken
    from that height and the panel's width (square for a figure without a height)."""

    def __init__(self, name: str, figure):
        super().__init__(name)
        self.figure = figure
        self.aspect = figure.layout.height / PANEL_WIDTH if figure.layout.height else 1.0

    def _create_gui_handle(self, viser_server) -> None:
        self.gui_handle = viser_server.gui.add_plotly(self.figure, aspect=self.aspect)

    def install(self, viser_server) -> None:
        self._create_gui_handle(viser_server)

    def show(self, figure) -> None:
        self.figure = figure
        if self.gui_handle is not None:
            self.gui_handle.figure = figure


class OdinPanel(torch.nn.Module):
    """The panel's elements (an nn.Module without parameters, so that nerfstudio's viewer finds them and the
    pipeline's state dict does not change)."""

    def __init__(self, world_size: int, policy: str, on_colour: Callable[[bool], None]):
        super().__init__()
        from odin_ns.model import owner_palette

        self.palette = owner_palette(world_size)
        self.colour_by_rank = ViewerCheckbox(
            "Colour by owning rank", False, cb_hook=lambda element: on_colour(bool(element.value)),
            hint="draw every Gaussian in the colour of the rank that owns it (refreshed with the model)")
        entry = POLICIES[policy]
        self.policy = ViewerText("Policy", entry.panel, disabled=True)
        self.ranks_text = ViewerText("Ranks", f"{world_size} (colours: " + ", ".join(
            f"{r} #{''.join(f'{int(255 * c):02x}' for c in self.palette[r])}" for r in range(world_size)) + ")",
            disabled=True)
        self.phase = ViewerText("Phase", "starting", disabled=True)
        self.shown = ViewerText("Gaussians shown", "-", disabled=True,
                                hint="the viewer draws a copy of the model on rank 0, at most "
                                     "--pipeline.viewer-max-gaussians of it (refreshed with the model)")
        self.stale = ViewerText("Stale reads admitted", "0 blocks" if entry.stale_reads else "none (exact)",
                                disabled=True)
        self.stale_reads = entry.stale_reads
        self.rank_rows = [ViewerText(f"Rank {r}", "-", disabled=True) for r in range(world_size)]
        for r, row in enumerate(self.rank_rows):
            setattr(self, f"rank_{r:03d}", row)  # attributes, so that the viewer finds them (in rank order)
        self.shares = ViewerPlotly("Render / wait", bar_chart([window_shares([])] * world_size))
        self.stale_total = 0

    def show(self, step: int, phase: str, shares_by_rank: List[Dict[str, float]], shown: int = 0,
             total: int = 0) -> None:
        """Rank 0, at a viewer refresh: the window's figures of every rank, and how many of the model's Gaussians
        the viewer draws (`runtime.viewer_snapshot`)."""
        self.phase.value = f"{phase} (step {step})"
        self.shown.value = f"{shown:,} of {total:,}" + (" (the most opaque)" if shown < total else " (all)")
        for r, shares in enumerate(shares_by_rank):
            self.rank_rows[r].value = describe(shares)
        self.stale_total += sum(s["stale_admitted"] for s in shares_by_rank)
        if self.stale_reads:
            self.stale.value = f"{self.stale_total} blocks"
        self.shares.show(bar_chart(shares_by_rank))


PANEL_NAME = "Odin"  # the panel's sub-module name on the pipeline: the folder's label in the viewer


def attach(pipeline, world_size: int, policy: str, on_colour: Callable[[bool], None]) -> None:
    """The panel on the pipeline, registered once, under the name the viewer shows as its folder."""
    pipeline.add_module(PANEL_NAME, OdinPanel(world_size, policy, on_colour))


def panel_of(pipeline) -> Optional[OdinPanel]:
    """The pipeline's panel (rank 0 of several), or None."""
    return pipeline._modules.get(PANEL_NAME)
