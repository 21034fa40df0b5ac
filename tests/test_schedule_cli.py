"""`odin-schedule`: the plan of a dataset without training, its JSON, its replay check and its bad input.

The plan it prints must be the plan the runtime makes (same views per step as the view order the engine builds,
phases covering the steps, read sets from the same blocks); its JSON must replay without deadlock; a hand-edited
list that deadlocks, a costs file that is not a stats file and an unknown scene must each end in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TINY_CITY
from odin_ns.cli.schedule import main as schedule_main
from odin_ns.schedule.costs import costs_from_stats
from odin_ns.schedule.plan import PhasePlan
from odin_ns.schedule.simulate import simulate


@pytest.fixture(scope="module")
def schedule_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule") / "schedule.json"
    assert schedule_main(["--ranks", "2", "--steps", "30", "--json", str(out),
                          "--pipeline.model.refine-every", "10"] + TINY_CITY) == 0
    return out


def test_plan_covers_the_steps_and_every_view_once_per_epoch(schedule_json):
    doc = json.loads(schedule_json.read_text())
    plans = [PhasePlan.from_dict(p) for p in doc["phases"]]
    assert plans[0].start == 0 and plans[-1].stop == 30
    assert all(a.stop == b.start for a, b in zip(plans, plans[1:]))
    assert len(plans) >= 3  # refine steps (every 10, and the opacity reset at 0) end phases
    steps = [[v for q in range(2) for v in p.rank_views(s, q)] for p in plans for s in range(p.start, p.stop)]
    n = doc["num_views"]
    whole = [v for views in steps[:n // 2] for v in views]  # steps that lie inside the first epoch
    assert len(set(whole)) == len(whole)
    assert {v for views in steps[:-(-n // 2)] for v in views} == set(range(n))  # every view in the first epoch
    for plan in plans:
        for step in range(plan.start, plan.stop):
            for q in range(2):
                for ids in plan.view_reads(step, q):
                    assert ids == sorted(ids) and all(doc["blocks"]["count"][b] > 0 for b in ids)
    pred = doc["predicted"]
    assert pred["odin"]["wall_s"] <= pred["odin-barrier"]["wall_s"]
    # no policy goes below the ideal (the busiest rank's render + update), and the barrier waits above it
    assert all(p["wall_s"] >= p["ideal_s"] - 1e-9 for p in pred.values())
    assert pred["odin-barrier"]["wait_s"] > 0 and pred["odin-barrier"]["wait_hidden"] == 0
    assert all(0 < e <= 1 for e, c in zip(doc["blocks"]["extent"], doc["blocks"]["count"]) if c)


def test_written_schedule_replays_and_a_deadlocking_edit_is_refused(schedule_json, tmp_path, capsys):
    assert schedule_main(["--check", str(schedule_json)]) == 0
    assert "without deadlock" in capsys.readouterr().out
    doc = json.loads(schedule_json.read_text())
    # rank 0 sends its gradients of step s to rank 1 only after waiting for rank 1's publication of step s,
    # which rank 1 sends after its update of s, which needs those gradients: a cycle
    for phase in doc["phases"]:
        acts = phase["actions"]["0"]
        sends = [i for i, a in enumerate(acts) if a.split(": ")[1].startswith("G ") and a.endswith("->r1")]
        for i in sends:
            step = int(acts[i].split(":")[0])
            later = [j for j, a in enumerate(acts) if a.startswith(f"{step + 1}: W ") and a.endswith("<-r1")]
            if later:
                moved = acts.pop(i)
                acts.insert(later[0], moved)
                break
        else:
            continue
        break
    else:
        pytest.fail("no step of the plan has rank 0 send to and then wait for rank 1")
    bad = tmp_path / "deadlock.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as info:
        schedule_main(["--check", str(bad)])
    message = str(info.value)
    assert message.startswith("odin: error:") and "deadlock" in message and "\n" not in message


def _check_refuses(doc, tmp_path, words):
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as info:
        schedule_main(["--check", str(bad)])
    message = str(info.value)
    assert message.startswith("odin: error:") and "\n" not in message, message
    assert all(w in message for w in words), message
    return message


def test_a_schedule_that_is_not_the_plans_is_refused(schedule_json, tmp_path):
    """The replay alone would accept lists without their sends and updates (it builds its expectations from the
    lists it is given); the check compares them with the plan's own lists first."""
    doc = json.loads(schedule_json.read_text())
    acts = doc["phases"][0]["actions"]
    kept = {r: [a for a in lines if not a.split(": ")[1].startswith(("G ", "U"))] for r, lines in acts.items()}
    assert all(len(kept[r]) < len(acts[r]) for r in acts), "the plan's first phase has no G or U to remove"
    _check_refuses(dict(doc, phases=[dict(doc["phases"][0], actions=kept)] + doc["phases"][1:]), tmp_path,
                   ["not the plan's program", "lacks", "rank 0"])
    # an extra publication, to a rank that does not read the block
    extra = {r: list(lines) for r, lines in acts.items()}
    step = int(extra["0"][0].split(":")[0])
    extra["0"].append(f"{step}: P b0->r0")
    _check_refuses(dict(doc, phases=[dict(doc["phases"][0], actions=extra)] + doc["phases"][1:]), tmp_path,
                   ["not in the plan", "P b0->r0"])
    # a render moved before the wait that validates its blocks
    swapped = {r: list(lines) for r, lines in acts.items()}
    lines = swapped["1"]
    w = next(i for i, a in enumerate(lines) if a.split(": ")[1].startswith("W "))
    r = next(i for i, a in enumerate(lines) if a.split(": ")[1].startswith("R ") and a.split(":")[0] ==
             lines[w].split(":")[0])
    lines.insert(w, lines.pop(r))
    _check_refuses(dict(doc, phases=[dict(doc["phases"][0], actions=swapped)] + doc["phases"][1:]), tmp_path,
                   ["comes before", "W b"])
    # a view's gradients sent before the view renders
    early = {r: list(lines) for r, lines in acts.items()}
    lines = early["0"]
    g = next(i for i, a in enumerate(lines) if a.split(": ")[1].startswith("G "))
    r = max(i for i, a in enumerate(lines[:g]) if a.split(": ")[1].startswith("R "))
    lines.insert(r, lines.pop(g))
    _check_refuses(dict(doc, phases=[dict(doc["phases"][0], actions=early)] + doc["phases"][1:]), tmp_path,
                   ["before it renders it", "G s0"])
    # actions given as a list instead of a map of ranks, and an action that does not parse
    _check_refuses(dict(doc, phases=[dict(doc["phases"][0], actions=acts["0"])]), tmp_path, ["must map each rank"])
    garbled = dict(acts, **{"0": acts["0"][:-1] + ["3: Q b1->r1"]})
    _check_refuses(dict(doc, phases=[dict(doc["phases"][0], actions=garbled)]), tmp_path, ["rank 0", "Q b1"])


def test_costs_from_a_stats_file_and_bad_costs(tmp_path):
    stats = {"meta": {}, "summary": {"phases": 2, "ranks": 2, "wait_s": {"phase": 0.4}},
             "steps": [{"views": [3], "compute_s": 0.1, "update_s": 0.01, "bookkeeping_s": 0.002, "loop_s": 0.0},
                       {"views": [3], "compute_s": 0.3, "update_s": 0.03, "bookkeeping_s": 0.002, "loop_s": 0.0},
                       {"views": [1, 2], "compute_s": 0.4, "update_s": 0.02, "bookkeeping_s": 0.0, "loop_s": 0.0}]}
    path = tmp_path / "odin_stats.json"
    path.write_text(json.dumps(stats))
    costs = costs_from_stats(path, num_views=5)
    assert costs.render(3) == pytest.approx(0.2) and costs.render(1) == pytest.approx(0.2)
    assert costs.render(0) == pytest.approx(0.2)  # never rendered: the mean of the others
    assert costs.update == pytest.approx(0.02) and costs.phase == pytest.approx(0.1)
    with pytest.raises(SystemExit, match="rendered view 3, this data has only 3"):
        costs_from_stats(path, num_views=3)
    not_stats = tmp_path / "config.json"
    not_stats.write_text(json.dumps({"method": "odin"}))
    for bad in (not_stats, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as info:
            costs_from_stats(bad, num_views=5)
        assert str(info.value).startswith("odin: error: --costs") and "\n" not in str(info.value)


def test_replay_keeps_the_measured_steps_where_the_views_match(tmp_path):
    """Two ranks render views 0 and 1 twice; each was slow once, on a different step. Replayed with the measured
    steps, the barrier waits for the slow rank at both steps (2.0 s); another schedule (the views swapped between
    ranks) is not what the run measured, so it gets the per-view means (0.55 s a view, 1.1 s)."""
    times = {(0, 0): 1.0, (0, 1): 0.1, (1, 0): 0.1, (1, 1): 1.0}  # (step, rank) -> render seconds
    steps = [{"step": t, "rank": r, "views": [r], "compute_s": c, "update_s": 0.0, "bookkeeping_s": 0.0,
              "loop_s": 0.0} for (t, r), c in times.items()]
    path = tmp_path / "odin_stats.json"
    path.write_text(json.dumps({"summary": {"phases": 1, "ranks": 2, "wait_s": {"phase": 0.0}}, "steps": steps}))
    costs = costs_from_stats(path, num_views=2)
    costs.latency = 0.0

    def plan(views):
        return PhasePlan(start=0, stop=2, num_ranks=2, owner=[0, 1], views=views,
                         reads=[[[[0, 1]], [[0, 1]]]] * 2, policy_name="barrier")

    measured = simulate([plan([[[0], [1]], [[0], [1]]])], costs)
    assert measured.wall_s == pytest.approx(2.0) and measured.busy_s == pytest.approx([1.1, 1.1])
    other = simulate([plan([[[1], [0]], [[1], [0]]])], costs)
    assert other.wall_s == pytest.approx(1.1)


def test_unknown_bench_scene_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "odin_ns.cli.bench", "train", "--scene", "moon", "--steps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  ")]
    assert lines == ["odin: error: unknown scene 'moon' (choose from city, city-aerial, fox)"], proc.stderr
