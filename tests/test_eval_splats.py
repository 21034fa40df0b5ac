"""An evaluation's render on several ranks (`runtime.eval_splats`; real gloo processes): rank 0 gets every owner's
visible splats in the order one process projects the whole model in, whatever the ownership (blocks of one rank
between another's, an empty block, a rank that owns nothing), and the image rasterized from them is one process's,
bit for bit; a camera that sees one Gaussian or none renders too."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from block_tables import rows_of, table_of
from gloo_ranks import run_ranks

from odin_ns.render import rasterization_cpu
from odin_ns.render.projection import RowCameras, partition_free
from odin_ns.render.splats import rasterize_splats
from odin_ns.runtime.eval_splats import EvalSplats
from odin_ns.runtime.sharded import PARAM_NAMES
from odin_ns.runtime.view_projection import project_rows
from odin_ns.runtime.waits import WaitLog

NUM_REST, W, H = 15, 40, 30
OWNER = [1, 0, 1, 0, 1, 1]  # rank 2 owns nothing; rank 0's blocks lie between rank 1's
COUNT = [70, 0, 90, 60, 80, 1]  # an empty block; the last block holds the one Gaussian behind the first camera


def _model():
    """The whole model in block order: most Gaussians in front of the first camera, the last one behind it."""
    g = torch.Generator().manual_seed(5)
    n = sum(COUNT)
    z = torch.rand(n, generator=g) * 6 + 1
    xy = (torch.rand(n, 2, generator=g) * 2 - 1) * z[:, None] * 0.8
    means = torch.cat([xy, z[:, None]], 1)
    means[-1] = torch.tensor([0.0, 0.0, -4.0])
    return {"means": means, "scales": torch.rand(n, 3, generator=g).log() * 0.7 - 3.0,
            "quats": torch.randn(n, 4, generator=g), "features_dc": torch.randn(n, 3, generator=g) * 0.5,
            "features_rest": torch.randn(n, NUM_REST, 3, generator=g) * 0.3,
            "opacities": torch.randn(n, 1, generator=g) * 2}


def _cameras():
    """Looking down +z (most Gaussians), down -z (the one behind), and from far away up +y (none)."""
    forward = torch.eye(4)
    backward = torch.diag(torch.tensor([-1.0, 1.0, -1.0, 1.0]))  # a half turn about y
    away = torch.eye(4)
    away[:3, :3] = torch.tensor([[1.0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]])  # looking up +y from y = 1000
    away[:3, 3] = -away[:3, :3] @ torch.tensor([0.0, 1000.0, 0.0])
    return [forward, backward, away]


K = torch.tensor([[30.0, 0, W / 2], [0, 30.0, H / 2], [0, 0, 1]])


def _rank(rank: int, world: int, results) -> None:
    torch.set_num_threads(1)
    whole, table, rows = _model(), table_of(OWNER, COUNT), rows_of(OWNER, COUNT, rank)
    model = SimpleNamespace(gauss_params={n: whole[n][rows] for n in PARAM_NAMES},
                            config=SimpleNamespace(rasterize_mode="classic"))
    engine = SimpleNamespace(model=model, table=table, env=SimpleNamespace(rank=rank, world_size=world),
                             device=torch.device("cpu"), num_rest=NUM_REST, log=WaitLog(rank))
    renders = EvalSplats(engine)
    if rank != 0:
        renders.serve()
        return
    try:
        for k, viewmat in enumerate(_cameras()):
            splats, radii = renders.request(viewmat[None], K[None], W, H, 3)
            # one process: the whole model projected in its order
            view = project_rows({n: whole[n] for n in PARAM_NAMES}, NUM_REST, RowCameras.one(viewmat, K, W, H),
                                3, False, keep_graph=False)
            results[f"splats {k}"] = (splats.shape[0], torch.equal(splats, view.splats),
                                      torch.equal(radii, view.radii))
            render, alpha, _ = rasterize_splats(splats, radii, W, H, "RGB+ED")
            colors = torch.cat([whole["features_dc"][:, None], whole["features_rest"]], 1)
            ref, ref_alpha, _ = rasterization_cpu(
                whole["means"], whole["quats"], partition_free(torch.exp, whole["scales"]),
                partition_free(torch.sigmoid, whole["opacities"]).squeeze(-1), colors, viewmat[None], K[None], W,
                H, sh_degree=3, packed=False, render_mode="RGB+ED")
            results[f"image {k}"] = (torch.equal(render, ref), torch.equal(alpha, ref_alpha),
                                     float(alpha.max()))
        results["renders"] = renders.renders
    finally:
        renders.stop()


def test_rank_0_renders_every_owners_splats_in_one_process_order():
    results = run_ranks(_rank, 3)
    many, one, none = (results[f"splats {k}"] for k in range(3))
    assert many[0] > 100 and many[1:] == (True, True), many
    assert one == (1, True, True) and none == (0, True, True), (one, none)
    for k in range(3):
        same_render, same_alpha, coverage = results[f"image {k}"]
        assert same_render and same_alpha, k
        assert (coverage > 0) == (k < 2), (k, coverage)
    assert results["renders"] == 3
