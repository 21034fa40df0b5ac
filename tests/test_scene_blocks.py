"""Morton codes and block layouts: exact bit interleaving, stable deterministic order, well-formed blocks whose
bounds contain their Gaussians, spatial coherence."""

import torch

from odin_ns.scene.blocks import BlockLayout, build_layout, refresh_bounds
from odin_ns.scene.morton import morton_decode, morton_encode, morton_order, quantize


def interleave_reference(x, y, z, bits=21):
    code = 0
    for i in range(bits):
        code |= ((x >> i) & 1) << (3 * i) | ((y >> i) & 1) << (3 * i + 1) | ((z >> i) & 1) << (3 * i + 2)
    return code


def test_morton_encode_matches_bitwise_reference_and_decodes():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 2**21, (500, 3), generator=g)
    q[0] = torch.tensor([2**21 - 1] * 3)  # all 63 bits set, still non-negative
    codes = morton_encode(q)
    assert (codes >= 0).all() and int(codes[0]) == 2**63 - 1
    assert [int(c) for c in codes] == [interleave_reference(*map(int, row)) for row in q]
    assert torch.equal(morton_decode(codes), q)


def test_quantize_clamps_and_uses_a_cube():
    p = torch.tensor([[0.0, 0.0, 0.0], [10.0, 1.0, 0.5], [-5.0, 20.0, 0.0]])
    q = quantize(p, torch.zeros(3, dtype=torch.float64), 10.0, bits=4)
    assert q.tolist() == [[0, 0, 0], [15, 1, 0], [0, 15, 0]]  # cells of edge 10/16 on every axis


def test_order_is_stable_for_ties():
    p = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    order, codes = morton_order(p)
    assert order.tolist() == [1, 3, 0, 2]
    assert (codes[1:] >= codes[:-1]).all()


def random_scene(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.rand(n, 3, generator=g) * torch.tensor([100.0, 60.0, 8.0])
    scales = torch.exp(torch.randn(n, 3, generator=g) - 2.0)
    return means, scales


def test_layout_well_formed_and_bounds_contain_members():
    means, scales = random_scene(10_000)
    lay = build_layout(means, scales, block_size=512)
    assert lay.num_blocks == 20 and lay.counts.tolist() == [512] * 19 + [10_000 - 19 * 512]
    assert torch.equal(torch.sort(lay.order).values, torch.arange(10_000))  # a permutation
    assert lay.offsets[0] == 0 and lay.offsets[-1] == 10_000
    reach = 3 * scales.amax(1, keepdim=True)
    for b in range(lay.num_blocks):
        m = lay.members(b)
        assert (lay.block_of[m] == b).all()
        assert torch.equal(lay.lo[b], means[m].amin(0)) and torch.equal(lay.hi[b], means[m].amax(0))
        assert (lay.ext_lo[b] <= (means[m] - reach[m]).amin(0)).all()
        assert (lay.ext_hi[b] >= (means[m] + reach[m]).amax(0)).all()
        assert lay.max_scale[b] == scales[m].max()


def test_layout_is_deterministic_and_round_trips_as_plain_data():
    means, scales = random_scene(5000, seed=1)
    a = build_layout(means, scales, block_size=300)
    b = build_layout(means.clone(), scales.clone(), block_size=300)
    c = BlockLayout.from_dict(a.to_dict())
    for f in ("order", "offsets", "block_of", "counts", "lo", "hi", "ext_lo", "ext_hi", "max_scale"):
        assert torch.equal(getattr(a, f), getattr(b, f)) and torch.equal(getattr(a, f), getattr(c, f))


def test_blocks_are_spatially_coherent():
    means, _ = random_scene(20_000, seed=2)
    lay = build_layout(means, block_size=500)
    vol = (lay.hi - lay.lo).prod(1)
    # a random grouping spans nearly the whole scene; Morton runs are far smaller
    rnd = build_layout(means[torch.randperm(20_000, generator=torch.Generator().manual_seed(0))], block_size=500)
    shuffled_vol = torch.stack([(means[rnd.order[i:i + 500]].amax(0) - means[rnd.order[i:i + 500]].amin(0)).prod()
                                for i in range(0, 20_000, 500)])
    assert vol.median() < 0.1 * (means.amax(0) - means.amin(0)).prod()
    assert vol.sum() < shuffled_vol.sum()


def test_refresh_bounds_and_edge_cases():
    means, scales = random_scene(1000, seed=3)
    lay = build_layout(means, scales, block_size=100)
    moved = means + 1.0
    new = refresh_bounds(lay, moved, scales)
    assert torch.equal(new.order, lay.order) and torch.allclose(new.lo, lay.lo + 1.0)
    empty = build_layout(torch.zeros(0, 3))
    assert empty.num_blocks == 0 and empty.offsets.tolist() == [0]
    one = build_layout(torch.ones(1, 3))
    assert one.num_blocks == 1 and one.max_scale.tolist() == [0.0]
