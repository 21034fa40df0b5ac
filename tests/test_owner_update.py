"""The owner's update on the touched rows (runtime/owner_update.py), alone in one process: what it reports is what
it did. Throughput-first's evidence (each row's squared change) must count every parameter, and a parameter
whose gradient and moments are zero (the SH coefficients above the active degree) must not change."""

from types import SimpleNamespace

import torch

from odin_ns.runtime.owner_update import OwnerUpdate
from odin_ns.runtime.sharded import PARAM_NAMES, pack_params, param_columns
from odin_ns.scene.selective_adam import SelectiveAdam

N, NUM_REST = 30, 15


def _model_and_optimizers(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = {"means": (3,), "scales": (3,), "quats": (4,), "features_dc": (3,), "features_rest": (NUM_REST, 3),
              "opacities": (1,)}
    params = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.randn((N,) + shapes[n], generator=g))
                                     for n in PARAM_NAMES})
    model = SimpleNamespace(gauss_params=params, strategy_state={})
    optimizers = SimpleNamespace(optimizers={n: SelectiveAdam([params[n]], lr=1e-2, eps=1e-15) for n in PARAM_NAMES})
    return model, optimizers, g


def _contribution(g, rows, width, rest_zero: bool):
    piece = torch.randn((len(rows), width + 3), generator=g)
    c0, c1 = param_columns(NUM_REST)["features_rest"]
    if rest_zero:
        piece[:, c0:c1] = 0
    piece[:, width + 1] = 1.0  # visible
    piece[:, width + 2] = torch.rand(len(rows), generator=g)
    return torch.tensor(rows), piece


def test_evidence_counts_every_parameter_and_a_parameter_without_gradient_does_not_change():
    model, optimizers, g = _model_and_optimizers(3)
    update = OwnerUpdate(model, NUM_REST, torch.device("cpu"))
    width = param_columns(NUM_REST)["opacities"][1]
    for step, rest_zero in enumerate((True, True, False)):
        contributions = [_contribution(g, [1, 4, 7, 9], width, rest_zero),
                         _contribution(g, [4, 5, 9, 20], width, rest_zero)]
        before = pack_params(model.gauss_params).clone()
        # the touched rows, as the splat path gives them (from its projections)
        result = update.run(contributions, torch.tensor([1, 4, 5, 7, 9, 20]), optimizers, track=True, evidence=True)
        after = pack_params(model.gauss_params)
        touched = [1, 4, 5, 7, 9, 20]
        assert result.rows.tolist() == touched
        untouched = [r for r in range(N) if r not in touched]
        assert torch.equal(before[untouched], after[untouched]), step
        expected = (after[touched] - before[touched]).double().pow(2).sum(dim=1)
        assert bool((expected > 0).all())
        torch.testing.assert_close(result.delta_sq, expected)  # every parameter's change, not one (sums in order)
        for name in PARAM_NAMES:  # the SH coefficients above the active degree: no gradient, no moment, no step
            c0, c1 = param_columns(NUM_REST)[name]
            changed = not torch.equal(before[:, c0:c1], after[:, c0:c1])
            assert changed == (name != "features_rest" or not rest_zero), (step, name)
