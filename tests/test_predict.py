"""The prediction at rank counts that do not run here: its link model, its GPU calibration, and `odin-bench
predict` end to end on the real garden point cloud (the replayed lists are the runtime's: test_program)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SHARED_DATA
from test_schedule_plan import _jitter_plan


def test_a_link_delays_each_message_by_its_bytes_and_a_rank_sends_one_after_another():
    from odin_ns.schedule.actions import parse_action
    from odin_ns.schedule.simulate import Costs, simulate, simulate_phase

    plan = _jitter_plan(barrier=True)
    base = dict(render=lambda v: 1.0, update=0.0, latency=0.0, phase=0.0)
    free = simulate([plan], Costs(**base))
    assert free.wall_s == 10.0
    # every step each rank sends its gradients to the other (one G of 2 blocks) and publishes its update (one P)
    sized = Costs(**base, bandwidth=100.0, message_bytes=lambda sender, a: 10.0 * len(a.blocks))
    slow = simulate([plan], sized)
    # a step: render, then G on the wire 0.2 s; the owner's update waits for it; then P 0.2 s, which the next
    # step's read waits for (the last step's update is read by no step of the phase)
    assert math.isclose(slow.wall_s, free.wall_s + 0.2 * (10 + 9), rel_tol=1e-9), slow.wall_s
    assert slow.busy_s == free.busy_s
    # rank 0 sends two messages at once: the second leaves when the first is on the other side
    lists = {0: [parse_action("G s0 b1->r1", 10), parse_action("G s0 b2,b3->r2", 10)],
             1: [parse_action("U b1", 10)], 2: [parse_action("U b2,b3", 10)]}
    ends = simulate_phase(lists, 10, sized, [0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert ends == pytest.approx([0.0, 0.1, 0.3], abs=1e-12)


def test_a_view_renders_once_its_own_payloads_are_in_while_the_next_views_travel():
    """A publication is a header and one payload per view: the reader's first view renders when its payload is in,
    the second waits for its own; as one payload, both wait for all of it."""
    from odin_ns.schedule.actions import parse_action
    from odin_ns.schedule.simulate import Costs, simulate_phase

    lists = {0: [parse_action("P b0->r1", 10)],
             1: [parse_action("W b0@v1 <-r0", 11), parse_action("R v0", 11), parse_action("R v1", 11)]}
    base = dict(render=lambda v: 1.0, update=0.0, latency=0.0, phase=0.0, bandwidth=100.0,
                message_bytes=lambda sender, a: 100.0)
    whole = simulate_phase(lists, 10, Costs(**base), [0.0, 0.0], [0.0, 0.0])
    assert whole == pytest.approx([0.0, 3.0])  # the payload in at 1.0, then two renders
    parts = simulate_phase(lists, 10, Costs(**base, message_parts=lambda sender, a: [(11, 0, 30.0), (11, 1, 70.0)]),
                           [0.0, 0.0], [0.0, 0.0])
    assert parts == pytest.approx([0.0, 2.3])  # view 0 at 0.3 - 1.3, view 1's payload in at 1.0: 1.3 - 2.3
    slow = simulate_phase(lists, 10, Costs(**base, message_parts=lambda sender, a: [(11, 0, 30.0), (11, 1, 170.0)]),
                          [0.0, 0.0], [0.0, 0.0])
    assert slow == pytest.approx([0.0, 3.0])  # view 1 waits for its payload (in at 2.0)


def test_the_published_calibration_reproduces_gsplats_training_times():
    """gsplat's 30k-step Mip-NeRF 360 times (docs, tests/eval; TITAN RTX): one GPU alone in the model within 16%."""
    from odin_ns.schedule.gpu_costs import GPUS, single_gpu_iteration_s

    published = {"bicycle": (6.26e6, 1237 * 822, 98.8), "bonsai": (1.25e6, 1559 * 1039, 47.4),
                 "counter": (1.21e6, 1558 * 1038, 54.0), "garden": (5.84e6, 1297 * 840, 100.4),
                 "kitchen": (1.79e6, 1558 * 1039, 67.3), "room": (1.59e6, 1557 * 1038, 56.9),
                 "stump": (4.81e6, 1245 * 825, 76.6)}
    for scene, (gaussians, pixels, ms) in published.items():
        model = 1000 * single_gpu_iteration_s(GPUS["published"], gaussians, pixels)
        assert abs(model - ms) / ms < 0.16, (scene, model, ms)


def test_grendels_model_shares_a_steps_renders_evenly_among_the_ranks():
    """The peer model's balancer at its best: every rank renders the step's mean; on the barrier's lists with
    views of alternating cost that takes the wait for the slow view away (10 s -> 7.5 s, the ideal), and a step's
    update and overhead stay each rank's own."""
    from odin_ns.schedule.peer_model import balanced_costs
    from odin_ns.schedule.simulate import Costs, simulate

    plan = _jitter_plan(barrier=True)
    slow = {(t, r): 1.0 if t % 2 == r else 0.5 for t in range(10) for r in range(2)}
    costs = Costs(render=lambda v: 0.0, update=0.0, latency=0.0, phase=0.0,
                  measured=lambda t, r: (tuple(plan.rank_views(t, r)), slow[(t, r)], 0.1 * r, 0.0))
    assert simulate([plan], costs).wall_s == pytest.approx(10.0 + 1.0)  # rank 1's updates, 0.1 s a step
    even = balanced_costs(costs, 2)
    assert even.measured(3, 0) == ((6,), 0.75, 0.0, 0.0) and even.measured(3, 1) == ((7,), 0.75, 0.1, 0.0)
    assert simulate([plan], even).wall_s == pytest.approx(7.5 + 1.0)
    with pytest.raises(ValueError):
        balanced_costs(Costs(render=lambda v: 1.0), 2)

@pytest.mark.skipif(not (SHARED_DATA / "garden_points.npz").exists(), reason="needs ../shared/data")
def test_predict_replays_every_policy_on_the_garden(tmp_path):
    from odin_ns.cli.bench import main

    out = tmp_path / "predict.json"
    assert main(["predict", "--ranks", "4", "--scenes", "garden", "--steps", "20", "--json", str(out),
                 "--out", str(tmp_path), "--peer"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    for p in row["policies"].values():  # against Grendel-GS's model, replayed on nerfstudio's random order
        assert math.isclose(p["speedup_over_peer"], p["views_per_s"] / row["peer"]["views_per_s"])
    policies = row["policies"]
    assert set(policies) == {"odin-barrier", "odin", "odin-throughput"} and row["gaussians"] == 5.84e6
    assert policies["odin-barrier"]["speedup"] == 1.0
    for name, p in policies.items():
        # one GPU per rank does every render and update: no policy beats the busiest rank's work
        assert p["wall_s"] >= p["ideal_s"] * (1 - 1e-9), name
        assert math.isclose(p["views_per_s"] * p["wall_s"], 4 * 2 * 20), name  # 2 views per rank and step
    assert policies["odin-throughput"]["wall_s"] <= policies["odin"]["wall_s"]
    assert (tmp_path / "predict.png").stat().st_size > 10_000


def test_a_blocks_visible_share_counts_its_points_in_the_image():
    import torch

    from odin_ns.schedule.visibility import visible_gaussians, visible_share
    from odin_ns.schedule.predict_scenes import look_at

    # block 0: 100 points at x in [-1, 1] (all in view of a camera on the -z side looking at the origin);
    # block 1: 50 points, the half with x > 0 far outside the image; block 2: behind the camera
    block0 = torch.stack([torch.linspace(-1, 1, 100), torch.zeros(100), torch.zeros(100)], dim=1)
    block1 = torch.stack([torch.linspace(-1, 1, 50) + 50 * (torch.arange(50) >= 25), torch.zeros(50),
                          torch.zeros(50)], dim=1)
    block2 = torch.tensor([[0.0, 0.0, -20.0]]).repeat(10, 1)
    means = torch.cat([block0, block1, block2])
    viewmat = look_at(torch.tensor([[0.0, 0.0, -10.0]]), torch.zeros(1, 3), up=(0.0, 1.0, 0.0))
    K = torch.tensor([[[100.0, 0.0, 50.0], [0.0, 100.0, 50.0], [0.0, 0.0, 1.0]]])
    share = visible_share(means, torch.tensor([100, 50, 10]), viewmat, K, 100, 100, samples=64)
    assert share.shape == (1, 3)
    assert share[0, 0] == 1.0 and share[0, 2] == 0.0
    assert abs(share[0, 1] - 0.5) < 0.03
    # the view order's cost: a view's Gaussians in its image, views of two sizes (each tested at its own): the
    # same camera with half the width, its principal point at the image's left edge, sees the half of block 0 at
    # world x <= 0 (the camera's x runs along world -x) and the whole near half of block 1 (x < 0): 50 + 25
    K_half = torch.tensor([[[100.0, 0.0, 0.0], [0.0, 100.0, 50.0], [0.0, 0.0, 1.0]]])
    counts = torch.tensor([100, 50, 10])
    full, half = visible_gaussians(means, counts, [(viewmat, K, 100, 100), (viewmat, K_half, 50, 100)])
    assert full == float((share[0].double() * counts).sum())
    assert half == float((visible_share(means, counts, viewmat, K_half, 50, 100)[0].double() * counts).sum())
    assert abs(half - 75.0) <= 2.0 and full >= 124.0


def test_an_unknown_scene_or_link_is_one_line():
    import subprocess
    import sys

    for args, words in ((["--scenes", "moon"], "unknown scene 'moon'"), (["--link", "carrier-pigeon"], "--link")):
        proc = subprocess.run([sys.executable, "-m", "odin_ns.cli.bench", "predict", *args], capture_output=True,
                              text=True)
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_the_splat_data_path_prices_one_splat_per_view_and_gaussian_seen():
    """Rows: a gradient message carries each remote row a rank's views see once (62 floats), a publication the rows
    the update touched (59). Splats: per (view, Gaussian) pair, 12 numbers out and 9 back, every step."""
    import torch

    from odin_ns.schedule.actions import parse_action
    from odin_ns.schedule.gpu_costs import (GPUS, GRAD_BYTES, PARAM_BYTES, SPLAT_BYTES, SPLAT_GRAD_BYTES,
                                            gpu_costs)
    from odin_ns.schedule.links import link

    plan = _jitter_plan(staleness=0)  # 2 ranks, 4 blocks (0, 1 of rank 0; 2, 3 of rank 1), every view reads all
    views = 2 * len(plan.views)
    visible = torch.zeros(views, 4)
    visible[:, 2] = 0.5  # every view sees half of block 2's rows, a quarter of block 3's, all of rank 0's
    visible[:, 3] = 0.25
    visible[:, :2] = 1.0
    counts = [100, 100, 40, 80]

    def priced(path):
        costs = gpu_costs([plan], [1.0] * views, [1.0] * views, counts, 1.0, GPUS["h200"], link("pcie"), visible,
                          data_path=path)
        return (costs.message_bytes(0, parse_action("G s0 b2,b3->r1", 4)),
                costs.message_bytes(1, parse_action("P b2,b3->r0", 4)))

    assert SPLAT_BYTES <= 48 and SPLAT_GRAD_BYTES <= 48  # the targets per pair, each way
    seen = 0.5 * 40 + 0.25 * 80  # rows of rank 1's blocks that rank 0's one view of a step sees
    grad, pub = priced("rows")
    assert grad == pytest.approx(seen * GRAD_BYTES)
    # block 2 and 3 rows the update of step 4 touched: those any view of the step (2 views) sees
    assert pub == pytest.approx((40 * (1 - 0.5 ** 2) + 80 * (1 - 0.75 ** 2)) * PARAM_BYTES)
    grad, pub = priced("splats")
    assert grad == pytest.approx(seen * SPLAT_GRAD_BYTES)
    assert pub == pytest.approx(seen * SPLAT_BYTES)  # rank 0's view of step 5 sees the same share
    with pytest.raises(ValueError, match="unknown data path"):
        priced("photons")


def test_a_view_renders_the_gaussians_in_its_image_where_the_model_was_calibrated_in_view():
    """h200 (its benchmark sees nearly every Gaussian it renders): a view pays a Gaussian's cost for each in its
    image and the culled share of it for each other Gaussian of the blocks it reads; the published model (per
    Gaussian of a whole scene) prices the Gaussians read; without the shares in view, both price the Gaussians
    read."""
    import torch

    from odin_ns.schedule.gpu_costs import CULLED_SHARE, GPUS, gpu_costs
    from odin_ns.schedule.links import link

    plan = _jitter_plan(staleness=0)  # 2 ranks, 4 blocks, every view reads all
    views = 2 * len(plan.views)
    counts = [100, 100, 40, 80]
    read = [float(sum(counts))] * views
    visible = torch.zeros(views, 4)
    visible[0] = torch.tensor([1.0, 0.5, 0.0, 0.25])  # view 0 sees 100 + 50 + 20 of its 320 Gaussians
    visible[1:] = 1.0
    scale, pixels = 1000.0, [1e6] * views

    def render(name, shares):
        gpu = GPUS[name]
        costs = gpu_costs([plan], read, pixels, counts, scale, gpu, link("pcie"), shares, data_path="splats")
        fixed = gpu.render_fixed_s + gpu.render_per_pixel_s * 1e6
        return [(costs.render(v) - fixed) / (gpu.render_per_gaussian_s * scale) for v in (0, 1)]

    assert render("h200", visible) == pytest.approx([170 + CULLED_SHARE * 150, 320])
    assert render("h200", None) == pytest.approx([320, 320])
    assert render("published", visible) == pytest.approx([320, 320])


def test_the_lanes_publications_carry_each_read_behind_once():
    """Throughput-first on splats: a read admitted behind is projected by its owner when its version is current, so
    the lane's publication of update u carries the splats of every read that takes u (the next step's current
    reads and later steps' reads behind): every read's splats travel once, in the message of its version."""
    import torch

    from odin_ns.schedule.gpu_costs import GPUS, gpu_costs
    from odin_ns.schedule.links import link

    exact, stale = _jitter_plan(staleness=0), _jitter_plan(staleness=1)
    views = 2 * len(exact.views)
    visible = torch.full((views, 4), 0.5)
    costs = gpu_costs([exact], [1.0] * views, [1.0] * views, [100, 100, 40, 80], 1.0, GPUS["h200"], link("pcie"),
                      visible, data_path="splats", stale_plans=[stale])

    def published(plan, sender):
        return {a.step: costs.message_bytes(sender, a) for a in plan.actions(sender) if a.kind == "P"}

    behind = [(a.step, a.peer) for r in (0, 1) for a in stale.actions(r) if a.kind == "W" and a.stale]
    assert behind, "the plan admits no read behind"
    for sender in (0, 1):
        lane, now = published(stale, sender), published(exact, sender)
        assert sum(lane.values()) == pytest.approx(sum(now.values()))  # the same splats, other messages
        assert lane != pytest.approx(now)


def _pairs_plan():
    """Blocks 0, 1 of rank 0 (100 and 40 rows), block 2 of rank 1 (70); a view of rank 1 reads blocks 0 and 1 at
    step 1 (140 of rank 0's rows: its largest pair), the others read fewer; rank 1 projects 70 rows at step 0, 140
    at step 1 (two views read block 2)."""
    from odin_ns.schedule.plan import PhasePlan

    return PhasePlan(start=0, stop=2, num_ranks=2, owner=[0, 0, 1], views=[[[0], [1]], [[2], [3]]],
                     reads=[[[[0]], [[2]]], [[[2]], [[0, 1, 2]]]], counts=[100, 40, 70])


def test_the_predicted_peak_holds_owned_rows_messages_and_the_largest_pair_graph():
    """A rank's predicted peak: its owned rows with Adam's moments, the step's messages, and the graph of the
    largest (view, its rows) pair it projects again at its update, at the step where their sum is largest (no
    budget); every pair's graph of a step whose graphs fit the budget."""
    from odin_ns.cli.bench_predict import GRAPH_ROW_BYTES, ROW_BYTES, peak_bytes

    class NoMessages:  # prices every message at zero bytes: what is left is rows and graphs
        @staticmethod
        def message_bytes(rank, action):
            return 0.0

    plan = _pairs_plan()
    peak = peak_bytes([plan], NoMessages(), scale=2.0)
    assert peak[0] == 2.0 * (3 * ROW_BYTES * 140 + GRAPH_ROW_BYTES * 140)
    assert peak[1] == 2.0 * (3 * ROW_BYTES * 70 + GRAPH_ROW_BYTES * 70)
    # graphs kept from P to U: every pair of the step at once (step 0: rank 1's view reads block 2, step 1: two
    # views read it)
    kept = peak_bytes([plan], NoMessages(), scale=2.0, keep_budget=math.inf)
    assert kept[0] == peak[0] and kept[1] == 2.0 * (3 * ROW_BYTES * 70 + GRAPH_ROW_BYTES * 140)
    # a budget keeps a step's graphs where they fit: rank 1's step 1 (two pairs of 70 rows, scale 2) at 280 rows'
    # worth, not at 279 (there its largest pair's graph, as projecting again)
    assert peak_bytes([plan], NoMessages(), scale=2.0, keep_budget=GRAPH_ROW_BYTES * 280.0) == kept
    assert peak_bytes([plan], NoMessages(), scale=2.0, keep_budget=GRAPH_ROW_BYTES * 279.0) == peak


def test_a_projection_made_again_is_priced_at_the_steps_whose_graphs_exceed_the_budget():
    """The update of an owner adds `RECOMPUTE_SHARE` of a render per projected pair where its step's graphs would
    hold more than the budget (--pipeline.projection-memory: 0 recompute, inf keep, auto between)."""
    from odin_ns.runtime.projection_memory import GRAPH_ROW_BYTES
    from odin_ns.schedule.gpu_costs import GPUS, RECOMPUTE_SHARE, gpu_costs
    from odin_ns.schedule.links import link

    plan, gpu = _pairs_plan(), GPUS["h200"]

    def updates(budget):
        costs = gpu_costs([plan], [1.0] * 4, [1.0] * 4, [100, 40, 70], 1.0, gpu, link("pcie"), data_path="splats",
                          keep_budget=budget)
        return [costs.measured(step, 1)[2] for step in (0, 1)]

    kept, again, between = updates(math.inf), updates(0.0), updates(GRAPH_ROW_BYTES * 100.0)
    extra = RECOMPUTE_SHARE * gpu.render_per_gaussian_s
    assert again[0] - kept[0] == pytest.approx(extra * 70) and again[1] - kept[1] == pytest.approx(extra * 140)
    assert between == [kept[0], again[1]]


def test_each_phase_start_adds_a_ranks_planning_and_the_read_sets_all_gather():
    """The prediction's phase starts: every rank's clock moves by the phase's planning, as timed, and its all-gather
    priced on the link as a ring ((ranks - 1) latencies and the bytes from the others); Grendel-GS's model plans
    nothing."""
    from odin_ns.schedule.gpu_costs import GPUS, gpu_costs
    from odin_ns.schedule.links import link
    from odin_ns.schedule.peer_model import balanced_costs
    from odin_ns.schedule.simulate import simulate

    plans = [_pairs_plan()]
    pcie = link("pcie")
    kwargs = dict(gaussians_read=[1.0] * 4, pixels=[1.0] * 4, counts=[100, 40, 70], scale=1.0, gpu=GPUS["h200"],
                  link=pcie, data_path="splats")
    none = gpu_costs(plans, **kwargs)
    timed = gpu_costs(plans, **kwargs, planning_s=[0.25], gather_bytes=[1e6])
    assert none.phase_start == [] and timed.phase_start == pytest.approx([0.25 + pcie.latency_s + 1e6 / pcie.bandwidth])
    assert simulate(plans, timed).wall_s == pytest.approx(simulate(plans, none).wall_s + timed.phase_start[0])
    assert simulate(plans, timed).busy_s == simulate(plans, none).busy_s
    assert balanced_costs(timed, 2).phase_start == ()


def test_a_ranks_timed_planning_makes_the_plans_one_process_makes():
    """`plan_timed` plans as rank 0 of several (its own views tested, the others' handed over as the all-gather
    would): the plans one process testing every view makes, each phase's time and the bytes a rank receives."""
    from test_shared_read_sets import _scene

    from odin_ns.schedule.phase_planner import PhasePlanner
    from odin_ns.schedule.planning_time import plan_timed
    from odin_ns.schedule.views import ViewSchedule

    table, camera = _scene()
    planner = PhasePlanner(3, 2, ViewSchedule(12, 3, 2, 7), camera)
    phases = [(0, 4, [0.1 * i for i in range(4)], [0.01 * i for i in range(4)]), (4, 9, (), ())]
    timed = plan_timed(planner, phases, table)
    alone = [planner.plan(start, stop, table, motion, growth) for start, stop, motion, growth in phases]
    assert timed.plans == alone and all(torch.equal(a.read_mask, b.read_mask) for a, b in zip(timed.plans, alone))
    assert timed.gather_bytes == [2 * 4 * 2 * 5, 2 * 5 * 2 * 5]  # 2 other ranks, steps x 2 views x 40 bits
    assert len(timed.planning_s) == 2 and all(0.0 < s < 10.0 for s in timed.planning_s)
