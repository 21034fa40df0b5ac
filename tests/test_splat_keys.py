"""A reader's keys for received splats (`splat_reader.received_keys`): from a count per block instead of a key per
splat, the splats of every owner and the reader's own sort into the order one process renders them in."""

from __future__ import annotations

import torch

from odin_ns.runtime.splat_reader import received_keys


def test_counts_per_block_sort_every_owners_splats_into_the_model_order():
    g = torch.Generator().manual_seed(3)
    ranks, n_blocks = 3, 40
    count = torch.randint(1, 30, (n_blocks,), generator=g)
    owner = torch.randint(0, ranks, (n_blocks,), generator=g)  # owners interleave in the block order
    global_start = torch.cumsum(count, 0) - count
    read = torch.rand(n_blocks, generator=g) < 0.7  # the view's read set
    me = 0
    true_keys, parts = [], []
    for o in range(ranks):
        blocks = torch.nonzero(owner == o).flatten()
        per_block, keys = [], []
        for b in blocks.tolist():  # visible rows of the block, ascending (some blocks read, none visible)
            visible = torch.nonzero(torch.rand(int(count[b]), generator=g) < 0.5).flatten() if read[b] else \
                torch.zeros(0, dtype=torch.int64)
            per_block.append(visible.numel())
            keys.append(global_start[b] + visible)
        keys = torch.cat(keys)
        true_keys.append(keys)
        parts.append(keys if o == me else received_keys(global_start, blocks, per_block, keys.numel()))
    assert sum(k.numel() for k in true_keys) > 200
    order = torch.argsort(torch.cat(parts))
    reference = torch.argsort(torch.cat(true_keys))  # the model's order: every splat by its Gaussian's place
    assert torch.equal(order, reference)
    received = torch.cat(parts[1:])
    assert not torch.equal(received, torch.cat(true_keys[1:]))  # the keys differ; only their order is the model's
