"""What ends a phase at the trainer's steps (`PhaseRules.of_trainer`), and how the channels keep NCCL's batches.

A viewer refresh (a whole-model gather) and an evaluation (renders from every owner's splats) are collectives on the
default group: on several ranks they must not run beside a phase's messages or a communication lane still sending,
so their step ends the phase, as a checkpoint's does. The trainings that run through such steps are in
test_viewer_panel (a refresh every 10 steps, throughput-first's lane on a thread), test_nerfstudio_tools and
test_distributed_equivalence (evaluations)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from odin_ns.runtime import transport
from odin_ns.runtime.waits import WaitLog
from odin_ns.schedule.phase_planner import PhaseRules


def _trainer(viewer: bool, save=0, image=0, batch=0, all_images=0, refresh=50, logger=True):
    return SimpleNamespace(steps_per_save=save, steps_per_eval_image=image, steps_per_eval_batch=batch,
                           steps_per_eval_all_images=all_images, is_viewer_enabled=lambda: viewer,
                           is_tensorboard_enabled=lambda: logger, is_wandb_enabled=lambda: False,
                           is_comet_enabled=lambda: False, pipeline=SimpleNamespace(viewer_refresh_every=refresh))


def _stops(rules, start=0, until=60):
    stops = []
    while start < until:
        start = rules.stop(start)
        stops.append(start)
    return stops


def test_a_refresh_or_an_evaluation_ends_its_phase_on_several_ranks():
    rules = PhaseRules(phase_length=25)
    rules.of_trainer(_trainer(True, save=40, image=7, refresh=10), first_step=0, steps=60, distributed=True)
    # evaluations at 7, 14, ..., refreshes at 10, 20, ..., the checkpoint at 40: each step ends its phase
    assert _stops(rules) == [8, 11, 15, 21, 22, 29, 31, 36, 41, 43, 50, 51, 57, 60]
    rules.of_trainer(_trainer(False, save=40, image=7, refresh=10), first_step=0, steps=60, distributed=True)
    assert _stops(rules) == [8, 15, 22, 29, 36, 41, 43, 50, 57, 60]  # no viewer: no refresh
    rules.of_trainer(_trainer(True, save=40, image=7, refresh=10, logger=False), first_step=0, steps=60,
                     distributed=True)
    assert _stops(rules) == [11, 21, 31, 41, 51, 60]  # no logger: nerfstudio evaluates nothing
    rules.of_trainer(_trainer(True, save=40, image=7, refresh=10), first_step=0, steps=60, distributed=False)
    assert _stops(rules) == [25, 41, 60]  # one process gathers nothing: its checkpoints and the length alone


@pytest.mark.parametrize("first", [0, 37])
def test_every_step_the_trainer_gathers_after_ends_its_phase(first):
    """The trainer's own predicates (nerfstudio's `step_check` over the evaluations that run, the refresh's
    condition) against the phases the rules cut, from the start and from a resumed step."""
    from nerfstudio.utils.misc import step_check

    from odin_ns.trainer import OdinTrainer

    config = _trainer(True, save=12, image=5, batch=9, all_images=30, refresh=7)
    trainer = SimpleNamespace(config=config)
    rules = PhaseRules(phase_length=25, refine_stop_iter=0)
    rules.of_trainer(config, first_step=first, steps=100, distributed=True)
    stops = set(_stops(rules, first, first + 100))
    gathers = [s for s in range(first, first + 100)
               if OdinTrainer._evaluates(trainer, s) or (s > 0 and s % 7 == 0) or step_check(s, 12)]
    assert len(gathers) > 20 and all(s + 1 in stops for s in gathers), sorted(set(gathers) - {s - 1 for s in stops})


class _Work:
    def is_completed(self):
        return False


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (P2POp asks for a default group); gone after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nccl_keeps_a_batch_of_one_send_and_never_waits_for_it(monkeypatch, one_rank_group):
    """NCCL coalesces every batch into one work, a lone send's too: it stays with the channels until done, and no
    thread waits for it (a wait would hold the rank's stream until the peer takes the send); gloo's sends go to
    the reaper (its one work per operation)."""
    batches = []
    monkeypatch.setattr(transport.dist, "batch_isend_irecv", lambda ops: batches.append(ops) or [_Work()])
    added = []
    channels = transport.Channels(torch.device("cuda"), WaitLog(0))
    monkeypatch.setattr(channels._reaper, "add", lambda *a: added.append(a))
    sent = torch.ones(3)
    assert channels.batch([(0, sent)], [], "transfer", kind="G") == []
    assert len(batches) == 1 and len(channels._pending) == 1 and channels._pending[0][1][0] is sent
    assert added == []
