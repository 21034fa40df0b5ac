"""Throughput-first's own-row versions: the mirror a render reads moves forward by the touched rows of each update."""

from __future__ import annotations

import pytest
import torch

from odin_ns.runtime.owned_versions import OwnedVersions


def test_the_mirror_equals_the_rows_at_each_version_and_never_goes_back():
    g = torch.Generator().manual_seed(0)
    live = torch.randn(50, 7, generator=g)
    history = {4: live.clone()}
    mirror = OwnedVersions(live.clone(), 4)
    for version in range(5, 9):  # each update changes some rows of the live state
        rows = torch.randperm(50, generator=g)[:9]
        live[rows] += torch.randn(9, 7, generator=g)
        buffer = live[rows]  # the caller may reuse its buffer after recording
        mirror.record(version, rows, buffer)
        buffer.zero_()
        history[version] = live.clone()
    assert mirror.latest == 8
    assert torch.equal(mirror.at(4), history[4])
    assert torch.equal(mirror.at(6), history[6])  # two updates applied at once
    assert torch.equal(mirror.at(6), history[6])
    assert torch.equal(mirror.at(8), history[8])
    with pytest.raises(RuntimeError, match="after version 8"):
        mirror.at(7)
    with pytest.raises(RuntimeError, match="update 9 was not recorded"):
        mirror.at(9)
