"""Grendel-GS as the prediction models it: the peer the paper's 64-GPU claim is measured against.

Grendel-GS (Zhao et al., "On Scaling Up 3D Gaussian Splatting Training") trains synchronously: every step each GPU
projects the Gaussians it owns (a spatial partition, as Odin's blocks), a sparse all-to-all sends the projected
splats to the GPUs that render the pixels they cover, the pixels of the batch's images are split among the GPUs by
a load balancer, the splats' gradients return the same way, and every GPU updates its own Gaussians; the batch's
images are drawn at random. What none of its code gives us is its clock on our scenes, so the prediction replays
its closest model with our own pieces:

- the views in nerfstudio's random order (`--pipeline.view-order random`), a step's B = ranks x micro-batch views;
- `odin-barrier`'s action lists on them: splats out, splat gradients back, a global barrier every step (the
  all-to-all is one), the same bytes per (view, Gaussian) pair as ours: with an image's pixels split among all
  GPUs a pair crosses the wire unless its owner renders its pixels, as likely as a random view's renderer owning it;
- each rank's render at a step the step's mean over the ranks: the load balancer's best case.

An estimate, not a bound: it leaves Grendel-GS's own overheads out (the balancer, the all-to-all's set-up, a
Gaussian sent to every GPU whose pixels it covers, not once), and it charges what our runtime pays and Grendel-GS
may not (a phase boundary every `--phase-length` steps, the runtime's own time per step, a gradient message per
view, an owner's projections made again at its update beyond the memory budget), but not our planning of a
phase's read sets and lists (`schedule.planning_time`): Grendel-GS plans none.
"""

from __future__ import annotations

import dataclasses

from odin_ns.schedule.simulate import Costs

MODEL = "Grendel-GS (model)"


def balanced_costs(costs: Costs, ranks: int) -> Costs:
    """`costs` (a plan's replay costs with per-(step, rank) figures) with every rank's render at a step replaced
    by the step's mean over the ranks: the pixels of the step's views split evenly among them."""
    measured = costs.measured
    if measured is None:
        raise ValueError("balanced_costs needs per-(step, rank) costs (gpu_costs gives them)")

    def at(step: int, rank: int):
        got = measured(step, rank)
        every = [measured(step, r) for r in range(ranks)]
        if got is None or any(m is None for m in every):  # a step not known for every rank: as it is
            return got
        views, _, update, overhead = got
        return views, sum(m[1] for m in every) / ranks, update, overhead

    return dataclasses.replace(costs, measured=at, phase_start=())  # no phases to plan
