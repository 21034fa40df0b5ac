"""The default block cut: k-d leaves of prescribed sizes (`scene.kd_split`), and the layout built on it.

What the cut must give (and each test can catch the loss of): a permutation whose consecutive runs have exactly the
requested sizes; at every split, the two sides separated along the axis of largest extent (so leaves are compact
and never interleave); leaves in depth-first order (consecutive blocks are neighbours); the same order on every
call, ties broken by row index; blocks far more compact than Morton runs on a scene whose Morton runs jump.
"""

from __future__ import annotations

import pytest
import torch

from odin_ns.scene.blocks import build_layout
from odin_ns.scene.kd_split import kd_order, leaf_sizes


def cloud(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=g) * torch.tensor([100.0, 40.0, 5.0])


def check_splits(points: torch.Tensor, run: torch.Tensor, sizes) -> None:
    """The run (rows of `points`) is the k-d split of `sizes`: recursively, the left leaves' points lie on one
    side of the right leaves' points along the axis on which the run extends most."""
    if len(sizes) == 1:
        return
    pts = points[run].double()
    axis = int(torch.argmax(pts.amax(0) - pts.amin(0)))
    half = len(sizes) // 2
    n_left = sum(sizes[:half])
    left, right = run[:n_left], run[n_left:]
    assert points[left, axis].max() <= points[right, axis].min(), (axis, len(sizes))
    check_splits(points, left, sizes[:half])
    check_splits(points, right, sizes[half:])


@pytest.mark.parametrize("n,block", [(1000, 64), (777, 100), (5, 1), (300, 1000)])
def test_leaves_have_the_sizes_and_split_along_the_longest_axis(n, block):
    points = cloud(n)
    sizes = leaf_sizes(n, block)
    assert sum(sizes) == n and max(sizes) <= block and max(sizes) - min(sizes) <= 1
    assert len(sizes) == -(-n // block)
    order = kd_order(points, sizes)
    assert torch.equal(torch.sort(order).values, torch.arange(n))
    check_splits(points, order, sizes)


def test_ties_are_broken_by_row_index_and_the_order_is_repeatable():
    points = torch.zeros(64, 3)
    points[32:, 0] = 1.0  # two stacks of identical points
    order = kd_order(points, [16] * 4)
    assert order.tolist() == list(range(64)), "equal points must keep their row order"
    shuffled = cloud(500, seed=3)
    assert torch.equal(kd_order(shuffled, leaf_sizes(500, 37)), kd_order(shuffled.clone(), leaf_sizes(500, 37)))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="sum to the 10 rows"):
        kd_order(cloud(10), [4, 4])
    with pytest.raises(ValueError):
        kd_order(cloud(10), [12, -2])


def test_kd_blocks_are_compact_where_morton_runs_jump():
    """A flat city-like slab (100 x 100 x 5): Morton runs that cross a large octree cell span much of it (their
    largest diagonal is the scene's), k-d leaves do not. Every block stays within its size and contains its
    members, and consecutive k-d blocks are neighbours (depth-first leaves)."""
    g = torch.Generator().manual_seed(1)
    means = torch.rand(20000, 3, generator=g) * torch.tensor([100.0, 100.0, 5.0])
    kd = build_layout(means, block_size=256, cut="kd")
    morton = build_layout(means, block_size=256, cut="morton")
    assert kd.counts.max() <= 256 and int(kd.counts.sum()) == means.shape[0]
    for lay in (kd, morton):
        for blk in range(lay.num_blocks):
            m = lay.members(blk)
            assert torch.equal(lay.lo[blk], means[m].amin(0)) and torch.equal(lay.hi[blk], means[m].amax(0))
    kd_diag, morton_diag = (kd.hi - kd.lo).norm(dim=1), (morton.hi - morton.lo).norm(dim=1)
    scene = (means.amax(0) - means.amin(0)).norm()
    assert morton_diag.max() > 0.5 * scene  # the jump the k-d cut exists to avoid
    assert kd_diag.max() < 0.2 * scene and kd_diag.quantile(0.9) < 0.7 * morton_diag.quantile(0.9)
    centres = (kd.lo + kd.hi) / 2
    assert (centres[1:] - centres[:-1]).norm(dim=1).median() < 0.25 * scene
