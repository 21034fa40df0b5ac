"""The live viewer's copy of the model on rank 0 (`runtime.viewer_snapshot`; real gloo processes): the whole model
in block order with each row's owner below the bound; above it, each rank's most opaque Gaussians, its share of
the bound by its share of the model (a rank owning nothing sends none), with their owners; the bound by default is
none on CPU ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from block_tables import rows_of, table_of
from gloo_ranks import run_ranks

from odin_ns.errors import OdinInputError
from odin_ns.runtime.sharded import PARAM_NAMES, ShardedGaussians, pack_params, unpack_params
from odin_ns.runtime.viewer_snapshot import gather_for_viewer, shares, viewer_limit
from odin_ns.runtime.waits import WaitLog

NUM_REST = 3
OWNER = [2, 0, 1, 0, 2]  # rank 1 owns an empty block only
COUNT = [4, 3, 0, 4, 4]


def _whole():
    g = torch.Generator().manual_seed(3)
    n = sum(COUNT)
    widths = {"means": (3,), "scales": (3,), "quats": (4,), "features_dc": (3,), "features_rest": (NUM_REST, 3),
              "opacities": (1,)}
    whole = {k: torch.randn((n,) + w, generator=g) for k, w in widths.items()}
    whole["opacities"] = torch.randperm(n, generator=g).float()[:, None]  # distinct: one top-k
    return whole


def _rank(rank: int, world: int, results) -> None:
    whole, table, rows = _whole(), table_of(OWNER, COUNT), rows_of(OWNER, COUNT, rank)
    env, log = SimpleNamespace(rank=rank, world_size=world), WaitLog(rank)
    model = SimpleNamespace(gauss_params={n: whole[n][rows] for n in PARAM_NAMES})
    sharded = ShardedGaussians(env, table, NUM_REST, torch.device("cpu"), log)

    def gather_full():
        got = sharded.gather_to(0, pack_params(model.gauss_params))
        return None if got is None else unpack_params(got, NUM_REST)

    engine = SimpleNamespace(table=table, env=env, model=model, device=torch.device("cpu"), log=log,
                             num_rest=NUM_REST, gather_full=gather_full)
    for limit in (None, 15, 6):
        snapshot, owners, shown, total = gather_for_viewer(engine, limit)
        if rank == 0:
            results[limit] = ({n: t.tolist() for n, t in snapshot.items()}, owners.tolist(), shown, total)


def test_the_viewer_gets_the_whole_model_below_its_bound_and_the_most_opaque_above():
    results = run_ranks(_rank, 3)
    whole = _whole()
    for limit in (None, 15):  # no bound, and a bound the model's 15 Gaussians meet
        snapshot, owners, shown, total = results[limit]
        assert (shown, total) == (15, 15)
        assert all(snapshot[n] == whole[n].tolist() for n in PARAM_NAMES)
        assert owners == [2] * 4 + [0] * 3 + [0] * 4 + [2] * 4
    snapshot, owners, shown, total = results[6]
    # 6 x 7/15 = 2.8 and 6 x 8/15 = 3.2: rounded down, the one left to the rank whose share lost most
    assert shares(6, (7, 0, 8)) == (3, 0, 3) and (shown, total) == (6, 15)
    assert owners == [0, 0, 0, 2, 2, 2]
    opacity = whole["opacities"].reshape(-1)
    mine = {0: torch.tensor([4, 5, 6, 7, 8, 9, 10]), 2: torch.tensor([0, 1, 2, 3, 11, 12, 13, 14])}
    expected = []
    for r, k in ((0, 3), (2, 3)):  # each rank's most opaque rows, in its order
        top = mine[r][torch.topk(opacity[mine[r]], k).indices.sort().values]
        expected.append(top)
    expected = torch.cat(expected)
    assert all(snapshot[n] == whole[n][expected].tolist() for n in PARAM_NAMES)


def test_shares_add_up_to_the_bound_and_never_pass_a_ranks_rows():
    assert shares(1, (7, 0, 8)) == (0, 0, 1)  # one Gaussian shown, not none
    assert shares(2, (1, 1, 1)) == (1, 1, 0) and shares(14, (7, 0, 8)) == (7, 0, 7)
    assert shares(5, (1, 0, 9)) == (1, 0, 4)  # 0.5 + 4.5: a rank gets no more than it owns


def test_the_bound_by_default_is_none_on_cpu_ranks_and_a_negative_one_is_refused():
    assert viewer_limit(0, torch.device("cpu"), 15) is None
    assert viewer_limit(1000, torch.device("cpu"), 15) == 1000
    from odin_ns.pipeline import OdinPipelineConfig

    with pytest.raises(OdinInputError, match="viewer-max-gaussians"):
        OdinPipelineConfig(viewer_max_gaussians=-1)
