"""Shards of splatfacto parameters (and optimizer state) reassemble into the full model bit for bit."""

import pytest
import torch

from odin_ns.scene.blocks import build_layout
from odin_ns.scene.gather import SPLATFACTO_KEYS, block_rows, gather_rows, reassemble, scatter_rows, shard
from odin_ns.scene.ownership import assign_by_readers, assign_contiguous


def splatfacto_params(n, sh_rest=15, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "means": torch.randn(n, 3, generator=g) * 20,
        "scales": torch.randn(n, 3, generator=g) - 3,
        "quats": torch.randn(n, 4, generator=g),
        "features_dc": torch.randn(n, 3, generator=g),
        "features_rest": torch.randn(n, sh_rest, 3, generator=g),
        "opacities": torch.randn(n, 1, generator=g),
    }


@pytest.mark.parametrize("ranks", [1, 3, 8])
def test_shard_then_reassemble_is_identity(ranks):
    params = splatfacto_params(5000)
    assert set(params) == set(SPLATFACTO_KEYS)
    lay = build_layout(params["means"], torch.exp(params["scales"]), block_size=128)
    own = assign_contiguous(lay.counts.numpy(), ranks)
    shards = shard(params, lay, own)
    assert [s.rank for s in shards] == list(range(ranks))
    assert sum(len(s.rows) for s in shards) == 5000
    out = reassemble(shards, 5000)
    for k, v in params.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_reassemble_with_non_contiguous_owners_and_reversed_shards():
    params = splatfacto_params(3001, sh_rest=3, seed=1)
    params["exp_avg"] = torch.randn(3001, 3, dtype=torch.float64)  # optimizer state travels the same way
    lay = build_layout(params["means"], block_size=100)
    aff = torch.rand(4, lay.num_blocks, generator=torch.Generator().manual_seed(2)).numpy()
    own = assign_by_readers(lay.counts.numpy(), aff, 4)
    out = reassemble(reversed(shard(params, lay, own)), 3001)
    for k, v in params.items():
        assert torch.equal(out[k], v), k


def test_block_rows_follow_layout_members():
    params = splatfacto_params(1000, seed=3)
    lay = build_layout(params["means"], block_size=64)
    blocks = [5, 0, 15, 3]
    rows = block_rows(lay, blocks)
    assert torch.equal(rows, torch.cat([lay.members(b) for b in blocks]))
    assert block_rows(lay, []).numel() == 0


def test_scatter_updates_only_its_rows_and_gather_detaches():
    params = splatfacto_params(500, seed=4)
    p = torch.nn.Parameter(params["means"].clone())
    rows = torch.tensor([3, 10, 499])
    got = gather_rows({"means": p}, rows)
    assert not got["means"].requires_grad and torch.equal(got["means"], params["means"][rows])
    full = {"means": params["means"].clone()}
    scatter_rows(full, rows, {"means": torch.zeros(3, 3)})
    keep = torch.ones(500, dtype=torch.bool)
    keep[rows] = False
    assert (full["means"][rows] == 0).all() and torch.equal(full["means"][keep], params["means"][keep])


def test_reassemble_rejects_gaps_and_overlaps():
    params = splatfacto_params(400, seed=5)
    lay = build_layout(params["means"], block_size=50)
    shards = shard(params, lay, assign_contiguous(lay.counts.numpy(), 2))
    with pytest.raises(ValueError):
        reassemble(shards[:1], 400)
    with pytest.raises(ValueError):
        reassemble(shards + shards[:1], 400)
