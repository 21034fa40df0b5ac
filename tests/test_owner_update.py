"""The owner's update on the touched rows (runtime/owner_update.py), alone in one process: what it reports is what
it did. Throughput-first's evidence (each row's squared change) must count every parameter, and a parameter
whose gradient and moments are zero (the SH coefficients above the active degree) must not change; skipping those
coefficients is the full update bit for bit, and is not done where their moments are not zero."""

from types import SimpleNamespace

import torch

from odin_ns.runtime.owner_update import OwnerUpdate, row_sums
from odin_ns.runtime.sharded import PARAM_NAMES, pack_params, param_columns
from odin_ns.scene.selective_adam import SelectiveAdam

N, NUM_REST = 30, 15


def _model_and_optimizers(seed: int, degree_at=lambda step: 3):
    g = torch.Generator().manual_seed(seed)
    shapes = {"means": (3,), "scales": (3,), "quats": (4,), "features_dc": (3,), "features_rest": (NUM_REST, 3),
              "opacities": (1,)}
    params = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.randn((N,) + shapes[n], generator=g))
                                     for n in PARAM_NAMES})
    model = SimpleNamespace(gauss_params=params, strategy_state={}, sh_degree_at=degree_at)
    optimizers = SimpleNamespace(optimizers={n: SelectiveAdam([params[n]], lr=1e-2, eps=1e-15) for n in PARAM_NAMES})
    return model, optimizers, g


def _contribution(g, rows, width, rest_zero: bool, trained: int = 0):
    """A view's contribution to `rows`; with `rest_zero`, zero gradients for the SH coefficients from `trained`."""
    piece = torch.randn((len(rows), width + 3), generator=g)
    c0, c1 = param_columns(NUM_REST)["features_rest"]
    if rest_zero:
        piece[:, c0 + 3 * trained:c1] = 0
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
        result = update.run(step, contributions, torch.tensor([1, 4, 5, 7, 9, 20]), optimizers, track=True,
                            evidence=True)
        after = pack_params(model.gauss_params)
        touched = [1, 4, 5, 7, 9, 20]
        assert result.rows.tolist() == touched
        untouched = [r for r in range(N) if r not in touched]
        assert torch.equal(before[untouched], after[untouched]), step
        # per parameter its columns' squared change (float32), the parameters' sums added in float64
        expected = sum((after[touched, c0:c1] - before[touched, c0:c1]).pow(2).sum(dim=1).double()
                       for c0, c1 in param_columns(NUM_REST).values())
        assert bool((expected > 0).all())
        # every parameter's change, not one; bit for bit (the sums in order, the squares' bits)
        assert torch.equal(result.delta_sq, expected)
        for name in PARAM_NAMES:  # the SH coefficients above the active degree: no gradient, no moment, no step
            c0, c1 = param_columns(NUM_REST)[name]
            changed = not torch.equal(before[:, c0:c1], after[:, c0:c1])
            assert changed == (name != "features_rest" or not rest_zero), (step, name)


def _state(model, optimizers):
    """Every parameter with its two moments (copies)."""
    out = []
    for name in PARAM_NAMES:
        param = model.gauss_params[name]
        state = optimizers.optimizers[name].state[param]
        out += [param.data.clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()]
    return out


def test_coefficients_above_the_degree_are_skipped_bit_for_bit_and_only_with_zero_moments():
    """An update at SH degree d runs Adam on the (d+1)^2 - 1 trained coefficients only: with the gradients a step at
    that degree gives (zero above it), the same parameters and moments, bit for bit, as the update of every
    coefficient, degree by degree up to 3. Where the moments of a coefficient above the degree are not zero (a state
    a checkpoint can bring), every coefficient is updated, as Adam would."""
    def degree_at(step):
        return min(step // 2, 3)

    width = param_columns(NUM_REST)["opacities"][1]
    skipping = _model_and_optimizers(11, degree_at)
    full = _model_and_optimizers(11)
    g = torch.Generator().manual_seed(12)
    touched = torch.tensor([1, 4, 5, 7, 9, 20])
    runs = [(model, optimizers, OwnerUpdate(model, NUM_REST, torch.device("cpu")))
            for model, optimizers, _ in (skipping, full)]
    widths = []
    for step in range(9):
        trained = (degree_at(step) + 1) ** 2 - 1
        contributions = [_contribution(g, [1, 4, 7, 9], width, True, trained),
                         _contribution(g, [4, 5, 9, 20], width, True, trained)]
        for model, optimizers, update in runs:
            update.run(step, contributions, touched, optimizers, track=True, evidence=True)
        widths.append(runs[0][2].coefficients.width(step, skipping[1].optimizers["features_rest"]))
        for a, b in zip(_state(*skipping[:2]), _state(*full[:2])):
            assert torch.equal(a, b), step
    assert widths == [0, 0, 3, 3, 8, 8, None, None, None]  # it did skip, degree by degree
    rest = full[0].gauss_params["features_rest"]
    assert bool((full[1].optimizers["features_rest"].state[rest]["exp_avg"][:, 8:] != 0).any())  # trained at 3

    # moments above the degree not zero: every coefficient is updated, as the full update does
    late = _model_and_optimizers(13, lambda step: 0)
    ref = _model_and_optimizers(13)
    late_update, ref_update = OwnerUpdate(late[0], NUM_REST, torch.device("cpu")), OwnerUpdate(ref[0], NUM_REST,
                                                                                                torch.device("cpu"))
    for model, optimizers, _ in (late, ref):
        state = optimizers.optimizers["features_rest"].state[model.gauss_params["features_rest"]]
        state.update(step=torch.tensor(5.0), exp_avg=torch.full((N, NUM_REST, 3), 0.1),
                     exp_avg_sq=torch.full((N, NUM_REST, 3), 0.01))
    contributions = [_contribution(g, [1, 4, 7, 9], width, True, 0)]
    for (model, optimizers, _), update in ((late, late_update), (ref, ref_update)):
        update.run(0, contributions, touched, optimizers, track=False, evidence=False)
    assert late_update.coefficients.width(0, late[1].optimizers["features_rest"]) is None
    # a moment of -0.0 above the degree (a loaded state's): not skipped either (an update over every coefficient
    # would make it +0.0, where skipping leaves it)
    signed = _model_and_optimizers(14, lambda step: 0)
    state = signed[1].optimizers["features_rest"].state[signed[0].gauss_params["features_rest"]]
    state.update(step=torch.tensor(5.0), exp_avg=torch.zeros((N, NUM_REST, 3)),
                 exp_avg_sq=torch.zeros((N, NUM_REST, 3)))
    coefficients = OwnerUpdate(signed[0], NUM_REST, torch.device("cpu")).coefficients
    assert coefficients.width(0, signed[1].optimizers["features_rest"]) == 0
    state["exp_avg"] = state["exp_avg"].clone()
    state["exp_avg"][3, 7, 1] = -0.0
    assert coefficients.width(0, signed[1].optimizers["features_rest"]) is None
    for a, b in zip(_state(*late[:2]), _state(*ref[:2])):
        assert torch.equal(a, b)


def test_the_in_place_masked_update_equals_the_gathered_one():
    """Where a step touches most of the owned rows the CPU update runs in place over every row with Adam a no-op on
    the untouched ones (`SelectiveAdam.step_touched`); it gives the gathered update's parameters, moments,
    densification statistics and evidence, bit for bit, with contributions that also carry rows no view saw (zero
    pieces, as a projection's rows outside the view). So does the update a GPU runs (gathered, the largest radius
    in one `index_reduce_`, the evidence's row sums torch's), run here on the CPU."""
    width = param_columns(NUM_REST)["opacities"][1]
    runs = []
    for share, cpu_ways in ((0.0, True), (1.0, True), (0.0, False)):  # always masked where not every row is
        # touched / never / a GPU's ways
        model, optimizers, _ = _model_and_optimizers(17, lambda step: min(step, 3))
        update = OwnerUpdate(model, NUM_REST, torch.device("cpu"))
        update.masked_share, update.cpu_ways = share, cpu_ways
        runs.append((model, optimizers, update, []))
    g = torch.Generator().manual_seed(18)
    for step in range(6):
        touched = sorted(torch.randperm(N, generator=g)[:20].tolist())
        trained = (min(step, 3) + 1) ** 2 - 1
        seen = _contribution(g, touched[:14], width, True, trained)
        other = _contribution(g, touched[8:], width, True, trained)
        unseen = [r for r in range(N) if r not in touched][:5]
        idx = torch.cat([seen[0], torch.tensor(unseen)])
        piece = torch.cat([seen[1], torch.zeros((len(unseen), width + 3))])
        for model, optimizers, update, results in runs:
            results.append(update.run(step, [(idx, piece), other], torch.tensor(touched), optimizers, track=True,
                                      evidence=True).delta_sq)
    (ma, oa, _, ra) = runs[0]
    for mb, ob, _, rb in runs[1:]:
        for x, y in zip(_state(ma, oa), _state(mb, ob)):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))
        for key in ("grad2d", "count", "radii"):
            assert torch.equal(ma.strategy_state[key], mb.strategy_state[key]), key
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))


def test_row_sums_are_torch_sums_bit_for_bit():
    """The evidence's per-row sums over a narrow parameter's columns (columns added in order on the CPU) are the
    bits of torch's `sum(dim=1)`, over squares spanning 70 decades (where the order of the additions shows)."""
    g = torch.Generator().manual_seed(5)
    for k in range(1, 7):
        x = (torch.randn(200_000, k, generator=g) * 2.0 ** torch.randint(-60, 60, (200_000, k), generator=g)).square()
        assert torch.equal(row_sums(x).view(torch.int32), x.sum(dim=1).view(torch.int32)), k
