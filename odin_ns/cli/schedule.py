"""`odin-schedule`: the plan of a dataset on N ranks, without training.

    odin-schedule --ranks N [--steps K] [--costs odin_stats.json] [--json FILE] [--actions] [METHOD] [ns-train args]
    odin-schedule --check FILE

Per phase and rank: the view order, the blocks each view reads, the ranks it waits for; the blocks' bound
extents; and, per policy, the predicted wall, wait and wait hidden, from a model of the renderer's costs or the
costs an earlier run measured (`--costs`: its odin_stats.json). `--json FILE` writes the whole schedule (plans,
per-rank action lists, predictions); `--check FILE` replays a schedule JSON, hand-edited action lists included,
and refuses (one line) one that would deadlock. METHOD (odin, odin-throughput, odin-barrier; default odin) and
the ns-train arguments after it are those of `odin-train`, data parser sub-command included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from odin_ns.errors import OdinInputError
from odin_ns.runtime.lane import resolve_lane
from odin_ns.schedule.conformance import check_lists
from odin_ns.schedule.costs import costs_from_stats, model_costs
from odin_ns.schedule.plan import PhasePlan, dependency_pairs
from odin_ns.schedule.policies import POLICIES
from odin_ns.schedule.actions import parse_action
from odin_ns.schedule.simulate import Costs, Deadlock, simulate

METHODS = tuple(p.method for p in POLICIES.values())
BASELINE = next(p.method for p in POLICIES.values() if p.barrier)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="odin-schedule", description=__doc__.split("\n")[0],
                                 epilog="Anything after these options goes to the method (ns-train arguments).")
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks to plan for (default 2)")
    ap.add_argument("--steps", type=int, default=50, help="steps to plan from --first-step (default 50)")
    ap.add_argument("--first-step", type=int, default=0)
    ap.add_argument("--costs", type=Path, help="odin_stats.json of an earlier run on the same data: its costs")
    ap.add_argument("--json", type=Path, help="write the whole schedule here")
    ap.add_argument("--actions", action="store_true", help="print every rank's action list")
    ap.add_argument("--check", type=Path, help="replay this schedule JSON (no training data needed)")
    return ap


def _method_config(training: List[str]):
    from odin_ns.cli.config_union import parse_odin_config
    from odin_ns.trainer import OdinTrainerConfig

    if not training or training[0] not in METHODS:
        training = ["odin"] + training
    config = parse_odin_config(training, "odin-schedule [options] METHOD")
    if not isinstance(config, OdinTrainerConfig):
        raise OdinInputError(f"method {config.method_name!r} is not an odin method (odin, odin-throughput, "
                             "odin-barrier)")
    if config.data:
        config.pipeline.datamanager.data = config.data
    return config


def replay_costs(config, preview, measured: Optional[Path]) -> Tuple[Costs, str]:
    """The replay's costs and where they come from: measured in a run's odin_stats.json, else the cost model;
    throughput-first's lane played where the configuration runs it (`--pipeline.lane`)."""
    if measured:
        costs, source = costs_from_stats(measured, preview.num_views), f"costs measured in {measured}"
    else:
        costs, source = model_costs(preview.gaussians_read, preview.pixels), "cost model"
    costs.inline_lane = resolve_lane(config.pipeline.lane, config.machine.device_type) == "inline"
    return costs, source


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(values):.1f} (min {min(values):g}, max {max(values):g})"


def phase_lines(plan: PhasePlan, gaussians: Sequence[float]) -> List[str]:
    """Readable summary of one phase: per rank its views in order, blocks read, whom it waits for."""
    n = plan.stop - plan.start
    lines = [f"phase steps {plan.start}-{plan.stop - 1} ({n} step{'s' * (n != 1)}), {plan.num_blocks} blocks, "
             f"motion bound at its end {plan.motion[-1] if plan.motion else 0.0:.4g}"]
    pairs = dependency_pairs(plan)
    for q in range(plan.num_ranks):
        views = [v for step in range(plan.start, plan.stop) for v in plan.rank_views(step, q)]
        sizes = [len(ids) for step in range(plan.start, plan.stop) for ids in plan.view_reads(step, q)]
        cost = sum(gaussians[v] for v in views)
        waits = ", ".join(f"r{o} at {k}/{n} steps" for (r, o), k in sorted(pairs.items()) if r == q) or "nobody"
        shown = " ".join(str(v) for v in views[:24]) + (" ..." if len(views) > 24 else "")
        lines.append(f"  rank {q}: views {shown}")
        lines.append(f"          blocks read per view {_spread(sizes)}, Gaussians read {cost:.0f}, waits for "
                     f"{waits}")
    return lines


def predictions(policy_plans: Dict[str, Sequence[PhasePlan]], costs: Costs) -> Dict[str, Dict[str, float]]:
    """Predicted wall, ideal, wait and wait hidden of every policy on the same views and read sets
    (odin-throughput: as if every read the plan admits behind were admitted at run time too)."""
    sims = {name: simulate(plans, costs) for name, plans in policy_plans.items()}
    barrier = sims[BASELINE]
    ideal = barrier.ideal_s
    out = {}
    for name, pred in sims.items():
        wait = pred.wall_s - ideal
        hidden = 1 - wait / (barrier.wall_s - ideal) if barrier.wall_s > ideal else float("nan")
        out[name] = {"wall_s": pred.wall_s, "ideal_s": ideal, "wait_s": wait, "wait_hidden": hidden,
                     "speedup": barrier.wall_s / pred.wall_s if pred.wall_s else float("nan")}
    return out


def _print_predictions(pred: Dict[str, Dict[str, float]], source: str) -> None:
    print(f"predicted ({source}):")
    print(f"  {'policy':<14}{'wall s':>9}{'ideal s':>9}{'wait s':>9}{'hidden':>8}{'speed-up':>10}")
    for name, p in pred.items():
        print(f"  {name:<14}{p['wall_s']:>9.2f}{p['ideal_s']:>9.2f}{p['wait_s']:>9.2f}{p['wait_hidden']:>8.0%}"
              f"{p['speedup']:>9.2f}x")


def _actions_json(plan: PhasePlan) -> Dict[str, List[str]]:
    """Per rank, "STEP: ACTION" strings (the form `--check` reads back, hand-edited or not)."""
    return {str(r): [f"{a.step}: {a!r}" for a in plan.actions(r)] for r in range(plan.num_ranks)}


def _given_lists(path: Path, index: int, plan: PhasePlan, given) -> Dict[int, List]:
    """The hand-written lists of one phase ({"RANK": ["STEP: ACTION", ...]}), parsed; bad input is one line."""
    where = f"--check {path}: phase {index}"
    if not isinstance(given, dict):
        raise OdinInputError(f"{where}: 'actions' must map each rank to its list of 'STEP: ACTION' strings "
                             f"(got a {type(given).__name__})")
    per_rank = {}
    for key, texts in given.items():
        if not str(key).isdigit():
            raise OdinInputError(f"{where}: {key!r} is not a rank number")
        if not isinstance(texts, list):
            raise OdinInputError(f"{where}: rank {key}: its actions must be a list (got a {type(texts).__name__})")
        acts = []
        for text in texts:
            step, sep, body = str(text).partition(":")
            try:
                if not sep or not step.strip().lstrip("-").isdigit():
                    raise ValueError(f"{text!r} is not 'STEP: ACTION'")
                acts.append(parse_action(body, int(step)))
            except (ValueError, IndexError) as exc:
                raise OdinInputError(f"{where}: rank {key}: {exc}") from None
        per_rank[int(key)] = acts
    return per_rank


def check_file(path: Path) -> int:
    """Replay a schedule JSON; its "actions" (if any) replace the lists its plans imply, and must be those lists
    (in any order a rank can run): anything else, or lists that deadlock, is refused in one line."""
    try:
        data = json.loads(path.read_text())
        plans = [PhasePlan.from_dict(p) for p in data["phases"]]
    except FileNotFoundError:
        raise OdinInputError(f"--check {path}: no such file") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise OdinInputError(f"--check {path}: not a schedule JSON written by odin-schedule --json ({exc})") from None
    if not plans:
        raise OdinInputError(f"--check {path}: the schedule has no phase")
    lists = []
    for i, (p, plan) in enumerate(zip(data["phases"], plans)):
        given = p.get("actions")
        lists.append({r: plan.actions(r) for r in range(plan.num_ranks)} if given is None
                     else _given_lists(path, i, plan, given))
    problem = check_lists(plans, lists)
    if problem is not None:
        raise OdinInputError(f"--check {path}: not the plan's program: {problem}")
    costs = Costs(render=lambda v: 0.01)
    try:
        pred = simulate(plans, costs, lists)
    except Deadlock as exc:
        raise OdinInputError(f"--check {path}: {exc}") from None
    print(f"odin-schedule: {path}: {len(plans)} phase(s) on {plans[0].num_ranks} ranks are the plan's and replay "
          f"without deadlock (wall {pred.wall_s:.2f} s at 10 ms per view)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, training = _parser().parse_known_args(argv)
    if args.check:
        return check_file(args.check)
    if args.ranks < 1:
        raise OdinInputError(f"--ranks {args.ranks}: need at least one rank")
    if args.steps < 1:
        raise OdinInputError(f"--steps {args.steps}: need at least one step")
    config = _method_config(training)
    from odin_ns.schedule.preview import build_preview

    preview = build_preview(config, args.ranks, args.steps, args.first_step)
    costs, source = replay_costs(config, preview, args.costs)
    print(f"odin-schedule: {config.method_name}, {args.ranks} rank(s), steps {args.first_step}-"
          f"{args.first_step + args.steps - 1}, {preview.num_views} training views, "
          f"{len(preview.block_counts)} blocks")
    for plan in preview.plans:
        print("\n".join(phase_lines(plan, preview.gaussians_read)))
        if args.actions:
            print("\n".join("    " + line for line in plan.actions_text().splitlines()))
    filled = [e for e, c in zip(preview.block_extent, preview.block_counts) if c]
    wide = sum(e > 0.25 for e in filled)
    print(f"block bounds (diagonal / the scene's): median {statistics.median(filled):.2f}, max {max(filled):.2f}, "
          f"{wide} of {len(filled)} blocks above 0.25")
    pred = predictions(preview.policy_plans(), costs)
    _print_predictions(pred, source)
    if args.json:
        doc = preview.to_dict()
        for p, plan in zip(doc["phases"], preview.plans):
            p["actions"] = _actions_json(plan)
        doc["predicted"] = pred
        doc["costs"] = source
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"odin-schedule: wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
