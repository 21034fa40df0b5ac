"""The action list is the program: every message a real 2-rank run sent and received is the one its lists say.

Each rank of a run records, when ODIN_NS_RECORD_MESSAGES is set (conftest sets it for the session), its program of
every phase (the action lists the simulator replays and `odin-schedule --actions` prints) and every message it
posted, in order (`runtime.transport.Channels`). For each policy's run on the shared city:
- the sends are the lists' G and P actions, in list order;
- exact policies: the receives are, in list order, one publication of update t-1 per W of step t and, at each U,
  one gradient message per G action of the step that another rank's list sends this rank (one per view);
- throughput-first: its lane receives as the evidence decides, but exactly the lists' messages: from each owner the
  publications the owner's lists address to the rank, in order, and at each U the gradients of that step's readers;
- every pair of ranks: the messages one rank sent the other, in order, are the messages the other received from it,
  in order (NCCL matches by order on a pair, never by tag; throughput-first's receives follow the evidence, but
  never reorder a pair).
Also: a handler that fails names the rank, the phase and the action.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from conftest import TINY_CITY, run_dir
from odin_ns.runtime.interpreter import ActionError, Program, StepContext
from odin_ns.schedule.actions import Action, parse_action
from test_distributed_equivalence import CITY, KEEP, city


def recorded(out, ranks=2):
    return [json.loads((run_dir(out) / f"odin_messages_rank{r}.json").read_text()) for r in range(ranks)]


def program_actions(record):
    """Every phase's list of the rank, parsed back from its repr."""
    out = []
    for start, lines in record["programs"]:
        acts = []
        for line in lines:
            step, _, body = line.partition(": ")
            acts.append(parse_action(body, int(step)))
        out.append(acts)
    return out


@pytest.mark.parametrize("method,micro_batch", [("odin-barrier", 1), ("odin", 1), ("odin-throughput", 1),
                                                ("odin", 2), ("odin-throughput", 2)])
def test_the_messages_of_a_run_are_its_action_lists(runs, method, micro_batch):
    # the runs other tests check (two views a rank: a view's gradients leave before the next view renders, on
    # throughput-first's lane too)
    extra = [] if method == "odin" or micro_batch > 1 else KEEP
    records = recorded(city(runs, 2, method, *extra, micro_batch=micro_batch))
    phases = [program_actions(r) for r in records]
    assert len(phases[0]) == len(phases[1]) >= 3
    if micro_batch > 1:
        assert any(a.kind == "G" and a.slot == 1 for phase in phases[0] for a in phase)
    for rank, record in enumerate(records):
        messages = [tuple(m) for m in record["messages"]]
        sends = [m for m in messages if m[3] == "send"]
        expected = [(a.kind, a.step, a.peer, "send") for phase in phases[rank] for a in phase if a.kind in "GP"]
        assert sends == expected, f"rank {rank}: the sends are not the lists' G and P actions"
        other = 1 - rank
        if method == "odin-throughput":
            # the lane receives as the evidence decides, but never other messages than the lists': from each owner
            # exactly the publications its lists address to this rank, in their order, and at each U one gradient
            # message of the step from every rank whose lists send G to this one, in list order
            publications = [("P", a.step, a.peer, "recv") for phase in phases[other] for a in phase
                            if a.kind == "P" and a.peer == rank]
            assert [m for m in messages if m[3] == "recv" and m[0] == "P"] == \
                [(k, t, other, d) for k, t, _, d in publications], f"rank {rank}: publications received"
            gradients = []
            for p, phase in enumerate(phases[rank]):
                for a in phase:
                    if a.kind == "U":  # one message per G of the step the other's list sends this rank
                        gradients += [("G", a.step, other, "recv") for b in phases[other][p]
                                      if b.kind == "G" and b.step == a.step and b.peer == rank]
            assert [m for m in messages if m[3] == "recv" and m[0] == "G"] == gradients, \
                f"rank {rank}: gradients received"
            continue
        wanted = []
        for p, phase in enumerate(phases[rank]):
            for a in phase:
                if a.kind == "W":
                    wanted.append(("P", a.step - 1, a.peer, "recv"))
                elif a.kind == "U":  # one message per G of the step the other's list sends this rank
                    wanted += [("G", a.step, other, "recv") for b in phases[other][p]
                               if b.kind == "G" and b.step == a.step and b.peer == rank]
                elif a.kind in "GP":
                    wanted.append((a.kind, a.step, a.peer, "send"))
        assert messages == wanted, f"rank {rank}: the messages are not the lists in order"
    # every pair: what one rank sent the other, in order, is what the other received from it, in order
    for a in (0, 1):
        b = 1 - a
        sent = [(m[0], m[1]) for m in records[a]["messages"] if m[3] == "send" and m[2] == b]
        got = [(m[0], m[1]) for m in records[b]["messages"] if m[3] == "recv" and m[2] == a]
        assert sent == got and sent, f"rank {a} -> rank {b}: sent {sent[:6]}..., received {got[:6]}..."


@pytest.mark.parametrize("method", ["odin-barrier", "odin", "odin-throughput"])
def test_the_prediction_replays_the_lists_the_runtime_ran(runs, method):
    """`odin-bench predict` and `odin-schedule` replay the plans `schedule.preview` makes without training; their
    lists (each policy's, from the registry) are the programs the ranks of a real run interpreted, phase for phase
    until the first densification (whose refined blocks only a run knows)."""
    from odin_ns.cli.schedule import _method_config
    from odin_ns.schedule.preview import build_preview

    extra = [] if method == "odin" else KEEP
    records = recorded(city(runs, 2, method, *extra))
    ran = [program_actions(r) for r in records]
    config = _method_config([method] + CITY + extra + TINY_CITY)
    plans = build_preview(config, 2).policy_plans()[method]
    refined = next(i for i, plan in enumerate(plans) if plan.start >= 20)  # refine at step 20 (conftest)
    assert refined >= 2
    for i, plan in enumerate(plans[:refined]):
        for rank in (0, 1):
            assert [repr(a) for a in plan.actions(rank)] == [repr(a) for a in ran[rank][i]], (method, i, rank)


def test_a_failing_handler_names_the_rank_the_phase_and_the_action():
    program = Program([Action("R", 4, view=2), Action("G", 4, 1, (3,), slot=0), Action("U", 4, blocks=(0,))],
                      rank=1, start=3, stop=6)
    assert [a.kind for a in program.renders[4]] == ["R"] and [a.kind for a in program.post[4]] == ["G", "U"]

    def broken(group, ctx):
        raise ValueError(f"no such block at step {ctx.step}")

    with pytest.raises(ActionError, match=r"rank 1, phase 3-5, step 4: G s0 b3->r1: ValueError: no such block at st"):
        program.run(program.post[4], defaultdict(lambda: lambda group, ctx: None, G=broken), StepContext(4, None))


def test_a_views_gradients_run_between_its_render_and_the_next():
    """An exact list sends a view's gradients before the next view renders: the program cuts them out between the
    renders; the last view's go with the update."""
    acts = [Action("W", 4, 0, (1,), (0,)), Action("R", 4, view=2), Action("G", 4, 0, (1,), slot=0),
            Action("R", 4, view=5), Action("G", 4, 0, (), slot=1), Action("U", 4, blocks=(3,))]
    program = Program(acts, rank=1, start=3, stop=6)
    assert [repr(a) for a in program.pre[4]] == ["W b1@v0 <-r0"]
    assert [repr(a) for a in program.renders[4]] == ["R v2", "R v5"]
    assert [[repr(a) for a in group] for group in program.between[4]] == [["G s0 b1->r0"]]
    assert [repr(a) for a in program.post[4]] == ["G s1 ->r0", "U b3"]
