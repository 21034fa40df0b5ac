"""SelectiveAdam: torch.optim.Adam(fused=True) when all rows are visible, untouched invisible rows, the documented
formula, shard-independent bits, state_dict, gsplat's densification ops and nerfstudio's optimizer plumbing."""

import io

import pytest
import torch

from odin_ns.scene.selective_adam import SelectiveAdam

SHAPES = {"means": (3,), "features_rest": (15, 3), "opacities": (1,)}


def make_params(n=257, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn((n,) + s, generator=g, dtype=dtype) for k, s in SHAPES.items()}


def grads_at(t, params, seed=1):
    # gradients of very different magnitudes per row, like a splatting loss
    g = torch.Generator().manual_seed(seed * 1000 + t)
    out = {}
    for k, v in params.items():
        mag = torch.rand((v.shape[0],) + (1,) * (v.dim() - 1), generator=g, dtype=v.dtype) ** 4
        out[k] = torch.randn(v.shape, generator=g, dtype=v.dtype) * mag
    return out


def mask_at(t, n, p=0.4, seed=2):
    g = torch.Generator().manual_seed(seed * 1000 + t)
    return torch.rand(n, generator=g) < p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("how", ["none", "all_true", "attribute"])
def test_all_visible_is_torch_fused_adam_bit_for_bit(dtype, how):
    """With every row visible SelectiveAdam is torch's fused Adam, bit for bit, on parameters that fill whole units
    of its kernel (256 rows); on the 257th row of a larger parameter the last elements take the kernel's vectorized
    path too (see `test_a_row_gets_the_same_bits_wherever_it_lies`), where torch's own call takes its scalar loop."""
    init = make_params(n=256, dtype=dtype)
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = SelectiveAdam([{"params": [p], "lr": 1e-2 * (i + 1)} for i, p in enumerate(ours.values())], eps=1e-15)
    opt_ref = torch.optim.Adam(
        [{"params": [p], "lr": 1e-2 * (i + 1)} for i, p in enumerate(ref.values())], eps=1e-15, fused=True
    )
    n = init["means"].shape[0]
    for t in range(30):
        for k, g in grads_at(t, init).items():
            ours[k].grad, ref[k].grad = g.clone(), g.clone()
        if how == "none":
            opt.step()
        elif how == "all_true":
            opt.step(torch.ones(n, dtype=torch.bool))
        else:
            opt.visibility = torch.ones(n, dtype=torch.bool)
            opt.step()
        opt_ref.step()
    for k in init:
        assert torch.equal(ours[k], ref[k]), k
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[ours[k]][s], opt_ref.state[ref[k]][s]), (k, s)


def test_a_row_gets_the_same_bits_wherever_it_lies():
    """A row's update depends on its own values alone, wherever the row lies in the parameter: the rows of
    parameters of 1-40 rows of 3 and of 1 element (most not whole units of the fused kernel), taken at several
    places of a parameter of 200 rows with moments of every size, get the bits those rows get in the whole
    parameter. (torch's fused Adam alone gives a parameter's last elements other bits here: its scalar loop.)"""
    g = torch.Generator().manual_seed(3)
    for width in (3, 1):
        n = 200
        p0, grad = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g) * 1e-3
        m0, v0 = torch.randn(n, width, generator=g) * 1e-3, torch.rand(n, width, generator=g) * 1e-6

        def stepped(rows: slice):
            p = torch.nn.Parameter(p0[rows].clone())
            opt = SelectiveAdam([p], lr=1e-2, eps=1e-15)
            opt.state[p].update(step=torch.tensor(4.0), exp_avg=m0[rows].clone(), exp_avg_sq=v0[rows].clone())
            p.grad = grad[rows].clone()
            opt.step()
            return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]

        whole = stepped(slice(None))
        for start in (0, 5, 11, 150):
            for length in list(range(1, 18)) + [31, 33, 40]:
                rows = slice(start, start + length)
                for part, full in zip(stepped(rows), whole):
                    assert torch.equal(part, full[rows]), (width, start, length)


def test_invisible_rows_untouched_and_visible_rows_move():
    init = make_params()
    params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = SelectiveAdam(list(params.values()), lr=1e-2)
    n = init["means"].shape[0]
    for t in range(12):
        for k, g in grads_at(t, init).items():
            params[k].grad = g
        vis = mask_at(t, n)
        before = {k: (p.detach().clone(), {s: opt.state[p][s].clone() for s in ("exp_avg", "exp_avg_sq")}
                      if opt.state[p] else None) for k, p in params.items()}
        opt.step(vis)
        for k, p in params.items():
            old_p, old_state = before[k]
            assert torch.equal(p[~vis], old_p[~vis]), k
            assert not torch.equal(p[vis], old_p[vis]), k
            for s in ("exp_avg", "exp_avg_sq"):
                now = opt.state[p][s]
                prev = old_state[s] if old_state is not None else torch.zeros_like(now)
                assert torch.equal(now[~vis], prev[~vis]), (k, s)
            assert float(opt.state[p]["step"]) == t + 1


def reference_float64(init, steps, lr, betas, eps, bias_correction):
    """The documented update, written independently in float64 with plain formulas."""
    b1, b2 = betas
    p = {k: v.double().clone() for k, v in init.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    n = init["means"].shape[0]
    for t in range(steps):
        grads = grads_at(t, init)
        vis = mask_at(t, n)
        step = t + 1
        for k in p:
            g = grads[k].double()
            rows = vis.view(-1, *([1] * (g.dim() - 1))).expand_as(g)
            new_m = b1 * m[k] + (1 - b1) * g
            new_v = b2 * v2[k] + (1 - b2) * g * g
            if bias_correction:
                upd = lr * (new_m / (1 - b1**step)) / (torch.sqrt(new_v / (1 - b2**step)) + eps)
            else:
                upd = lr * new_m / (torch.sqrt(new_v) + eps)
            p[k] = torch.where(rows, p[k] - upd, p[k])
            m[k] = torch.where(rows, new_m, m[k])
            v2[k] = torch.where(rows, new_v, v2[k])
    return p


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_float64_formula(bias_correction, dtype):
    lr, betas, eps, steps = 1e-2, (0.9, 0.999), 1e-8, 25
    init = make_params(dtype=dtype)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = SelectiveAdam(list(params.values()), lr=lr, betas=betas, eps=eps, bias_correction=bias_correction)
    n = init["means"].shape[0]
    for t in range(steps):
        for k, g in grads_at(t, init).items():
            params[k].grad = g
        opt.step(mask_at(t, n))
    ref = reference_float64(init, steps, lr, betas, eps, bias_correction)
    # Each update is at most ~3.2 lr per element; float32 rounding of m, v and p over 25 steps stays far below
    # 1e-4 lr per step. float64 differs from the reference only by op order (lerp vs b1*m + (1-b1)*g).
    atol = steps * lr * (1e-4 if dtype == torch.float32 else 1e-12)
    for k in init:
        err = (params[k].detach().double() - ref[k]).abs().max().item()
        assert err <= atol, (k, err, atol)
        # and the update is not trivially zero
        assert (ref[k] - init[k].double()).abs().max().item() > 2 * lr


def test_first_uncorrected_update_is_gsplats():
    # gsplat's kernel, step 1 from zero moments: p -= lr * (1-b1) g / (sqrt(1-b2) |g| + eps)
    p = torch.nn.Parameter(torch.zeros(4, 1, dtype=torch.float64))
    p.grad = torch.tensor([[2.0], [-3.0], [0.5], [1.0]], dtype=torch.float64)
    SelectiveAdam([p], lr=0.1, eps=0.0, bias_correction=False).step(torch.tensor([1, 1, 1, 0]))
    expected = -0.1 * 0.1 / 0.001**0.5 * torch.tensor([[1.0], [-1.0], [1.0], [0.0]], dtype=torch.float64)
    assert torch.allclose(p.detach(), expected, rtol=1e-12, atol=0)


def test_shard_update_equals_full_update_bits():
    """An owner updating only its rows gets the bits the single-process reference gets for them."""
    init = make_params(n=999)
    n = 999
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(5))[:400].sort().values
    full = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    part = {k: torch.nn.Parameter(v[rows].clone()) for k, v in init.items()}
    opt_full = SelectiveAdam(list(full.values()), lr=3e-3, eps=1e-15)
    opt_part = SelectiveAdam(list(part.values()), lr=3e-3, eps=1e-15)
    for t in range(20):
        grads, vis = grads_at(t, init), mask_at(t, n, p=0.6)
        for k, g in grads.items():
            full[k].grad = g
            part[k].grad = None if t % 7 == 3 else g[rows]  # an owner may get no gradient at some steps
        part_vis = torch.zeros(len(rows), dtype=torch.bool) if t % 7 == 3 else vis[rows]
        if t % 7 == 3:
            for g in grads.values():
                g[rows] = 0.0
            vis[rows] = False
        opt_full.step(vis)
        opt_part.step(part_vis)
    for k in init:
        assert torch.equal(full[k].detach()[rows], part[k].detach()), k
        for s in ("exp_avg", "exp_avg_sq", "step"):
            a, b = opt_full.state[full[k]][s], opt_part.state[part[k]][s]
            assert torch.equal(a if s == "step" else a[rows], b), (k, s)


def test_state_dict_round_trip():
    init = make_params()
    n = init["means"].shape[0]
    a = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt_a = SelectiveAdam(list(a.values()), lr=1e-2, betas=(0.8, 0.99), bias_correction=False)
    for t in range(5):
        for k, g in grads_at(t, init).items():
            a[k].grad = g
        opt_a.step(mask_at(t, n))
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    b = {k: torch.nn.Parameter(v.detach().clone()) for k, v in a.items()}
    opt_b = SelectiveAdam(list(b.values()), lr=1.0)  # hyperparameters come from the state dict
    opt_b.load_state_dict(torch.load(buf))  # weights_only=True: the state dict is plain tensors and numbers
    assert opt_b.param_groups[0]["betas"] == (0.8, 0.99) and opt_b.param_groups[0]["bias_correction"] is False
    for t in range(5, 10):
        for k, g in grads_at(t, init).items():
            a[k].grad, b[k].grad = g, g.clone()
        opt_a.step(mask_at(t, n))
        opt_b.step(mask_at(t, n))
    for k in init:
        assert torch.equal(a[k], b[k])


def test_visibility_attribute_is_consumed_and_checked():
    p = torch.nn.Parameter(torch.zeros(5, 3))
    opt = SelectiveAdam([p], lr=0.1)
    p.grad = torch.ones(5, 3)
    opt.visibility = torch.tensor([True, False, False, False, False])
    opt.step()
    assert opt.visibility is None
    assert (p[0] != 0).all() and (p[1:] == 0).all()
    opt.step()  # no mask: dense
    assert (p[1:] != 0).all()
    with pytest.raises(ValueError):
        opt.step(torch.ones(4, dtype=torch.bool))
    strict = SelectiveAdam([p], lr=0.1, require_visibility=True)
    with pytest.raises(RuntimeError):
        strict.step()
    before = p.detach().clone()
    p.grad = None
    opt.step(torch.ones(5, dtype=torch.bool))  # no gradient: the step count advances, nothing else
    assert torch.equal(p, before) and float(opt.state[p]["step"]) == 4


def test_gsplat_strategy_ops_on_state():
    from gsplat.strategy import DefaultStrategy
    from gsplat.strategy.ops import duplicate, remove, split

    n = 64
    g = torch.Generator().manual_seed(3)
    params = torch.nn.ParameterDict({
        "means": torch.randn(n, 3, generator=g),
        "scales": torch.randn(n, 3, generator=g) - 2.0,
        "quats": torch.randn(n, 4, generator=g),
        "opacities": torch.randn(n, generator=g),
        "sh0": torch.randn(n, 1, 3, generator=g),
        "shN": torch.randn(n, 15, 3, generator=g),
    })
    opts = {k: SelectiveAdam([{"params": [p], "lr": 1e-2, "name": k}], eps=1e-15) for k, p in params.items()}
    DefaultStrategy().check_sanity(params, opts)

    def train_step(t, vis):
        loss = sum((p**2).sum() * (i + 1) for i, p in enumerate(params.values()))
        loss.backward()
        for o in opts.values():
            o.step(vis)
            o.zero_grad()

    for t in range(3):
        train_step(t, mask_at(t, len(params["means"])))
    old = {k: (p.detach().clone(), opts[k].state[p]["exp_avg"].clone()) for k, p in params.items()}
    state = {}
    mask = torch.zeros(n, dtype=torch.bool)
    mask[::5] = True
    duplicate(params, opts, state, mask)
    n1 = n + int(mask.sum())
    for k, p in params.items():
        st = opts[k].state[p]
        assert p.shape[0] == n1 and st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape
        assert torch.equal(st["exp_avg"][:n], old[k][1]) and (st["exp_avg"][n:] == 0).all()
        assert float(st["step"]) == 3
    split(params, opts, state, torch.arange(n1) % 7 == 0)
    keep = torch.arange(len(params["means"])) % 3 != 1
    before = {k: (p.detach()[keep].clone(), opts[k].state[p]["exp_avg_sq"][keep].clone()) for k, p in params.items()}
    remove(params, opts, state, ~keep)
    for k, p in params.items():
        assert torch.equal(p.detach(), before[k][0]) and torch.equal(opts[k].state[p]["exp_avg_sq"], before[k][1])
    vis = mask_at(9, len(params["means"]))
    frozen = {k: p.detach()[~vis].clone() for k, p in params.items()}
    train_step(9, vis)
    for k, p in params.items():
        assert torch.equal(p.detach()[~vis], frozen[k])
        assert float(opts[k].state[p]["step"]) == 4


def test_gsplat_default_strategy_refine():
    """DefaultStrategy's own grow/prune/reset path runs on SelectiveAdam state (fake projection info)."""
    from gsplat.strategy import DefaultStrategy

    n = 200
    g = torch.Generator().manual_seed(4)
    params = torch.nn.ParameterDict({
        "means": torch.randn(n, 3, generator=g),
        "scales": torch.log(torch.rand(n, 3, generator=g) * 0.05),
        "quats": torch.randn(n, 4, generator=g),
        "opacities": torch.randn(n, generator=g) * 3,
        "sh0": torch.randn(n, 1, 3, generator=g),
    })
    opts = {k: SelectiveAdam([p], lr=1e-3) for k, p in params.items()}
    strategy = DefaultStrategy(refine_start_iter=0, refine_every=2, reset_every=4, grow_grad2d=1e-4,
                               prune_opa=0.05)
    strategy.check_sanity(params, opts)
    st = strategy.initialize_state(scene_scale=1.0)
    for step in range(1, 5):
        m = len(params["means"])
        means2d = torch.zeros(1, m, 2, requires_grad=True)
        info = {"width": 64, "height": 64, "n_cameras": 1, "radii": torch.ones(1, m, dtype=torch.int32) * 3,
                "gaussian_ids": None, "means2d": means2d}
        loss = (params["means"].sum() + params["scales"].sum() + params["opacities"].sum()
                + params["quats"].sum() + params["sh0"].sum() + (means2d * torch.rand(1, m, 2, generator=g)).sum())
        loss.backward()
        vis = info["radii"][0] > 0
        for o in opts.values():
            o.step(vis)
            o.zero_grad()
        strategy.step_post_backward(params, opts, st, step, info)
        for k, p in params.items():
            s = opts[k].state[p]
            assert s["exp_avg"].shape == p.shape and s["exp_avg_sq"].shape == p.shape
    assert len(params["means"]) != n  # something was grown or pruned


def test_nerfstudio_config_and_optimizers_wrapper():
    from nerfstudio.engine.optimizers import Optimizers
    from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig

    from odin_ns.scene.optimizer_config import SelectiveAdamOptimizerConfig

    cfg = SelectiveAdamOptimizerConfig(lr=1e-2, eps=1e-15)
    p = torch.nn.Parameter(torch.zeros(6, 3))
    q = torch.nn.Parameter(torch.zeros(6, 1))
    opts = Optimizers(
        {
            "means": {"optimizer": cfg, "scheduler": ExponentialDecaySchedulerConfig(lr_final=1e-3, max_steps=10)},
            "opacities": {"optimizer": SelectiveAdamOptimizerConfig(lr=5e-2, bias_correction=False),
                          "scheduler": None},
        },
        {"means": [p], "opacities": [q]},
    )
    o = opts.optimizers["means"]
    assert isinstance(o, SelectiveAdam)
    assert o.param_groups[0]["initial_lr"] == 1e-2 and o.param_groups[0]["eps"] == 1e-15
    assert opts.optimizers["opacities"].param_groups[0]["bias_correction"] is False
    vis = torch.tensor([True, True, False, False, True, False])
    for _ in range(3):
        p.grad, q.grad = torch.ones(6, 3), torch.ones(6, 1)
        for opt in opts.optimizers.values():
            opt.visibility = vis
        opts.optimizer_step_all()
        opts.scheduler_step_all(0)
        opts.zero_grad_all()
    assert (p[vis] != 0).all() and (p[~vis] == 0).all() and (q[~vis] == 0).all()
    assert o.param_groups[0]["lr"] < 1e-2  # the scheduler drives SelectiveAdam like Adam


def test_step_rows_equals_a_masked_step_through_parameter_replacements():
    """`step_rows` (the owners' update of the touched rows) is `step(visibility)` with those rows visible, bit for
    bit, and its step count stays right when the parameter is replaced with its state moved along (as
    densification and rebuilds do): here the replacement alternates between two parameter objects, as memory
    reuse can hand a new parameter an old one's id."""
    g = torch.Generator().manual_seed(5)
    init = torch.randn(40, 3, generator=g)
    pa, pb = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    spare = torch.nn.Parameter(init.clone())
    a, b = SelectiveAdam([pa], lr=1e-2), SelectiveAdam([pb], lr=1e-2)
    for t in range(12):
        grad = torch.randn(40, 3, generator=g)
        mask = torch.rand(40, generator=g) < 0.5
        rows = torch.nonzero(mask).flatten()
        a.step_rows(rows, grad[rows])
        pb.grad = torch.where(mask[:, None], grad, torch.zeros_like(grad))
        b.step(mask)
        assert torch.equal(pa, pb) and torch.equal(a.state[pa]["step"], b.state[pb]["step"]), t
        if t % 3 == 2:  # replace a's parameter, moving its state (the engine's _replace_param)
            new = spare
            new.data.copy_(pa.data)
            state = a.state.pop(pa)
            a.param_groups[0]["params"] = [new]
            a.state[new] = state
            spare, pa = pa, new


def test_step_touched_equals_step_rows_bit_for_bit():
    """`step_touched` (in place over every row, the untouched rows written back as they were) gives the bits
    `step_rows` gives (gathered rows), parameters and moments, signs of zeros included, on a whole parameter and on
    the leading SH coefficients of one (strided views, a strided gradient), through steps with different touched
    rows; in float32 and float64."""
    g = torch.Generator().manual_seed(21)
    for shape, width, dtype in (((3,), None, torch.float32), ((15, 3), 8, torch.float32), ((1,), None, torch.float32),
                                ((4,), None, torch.float32), ((4,), None, torch.float64),
                                ((15, 3), None, torch.float64)):
        n = 301
        init = torch.randn((n,) + shape, generator=g, dtype=dtype)
        init[::5] = -0.0  # a parameter's sign of zero stays where its row is not touched
        pa, pb = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
        a, b = SelectiveAdam([pa], lr=3e-2, eps=1e-15), SelectiveAdam([pb], lr=3e-2, eps=1e-15)
        # moments of either sign from the start (a -0.0 parameter beside a negative first moment: 0 * m is +0.0
        # there, which must not reach the parameter), on every other row
        odd = (torch.arange(n) % 2 == 1).view((n,) + (1,) * len(shape))
        # +0.0 elsewhere (Adam makes no -0.0)
        m0 = torch.where(odd, torch.randn((n,) + shape, generator=g, dtype=dtype), 0.0)
        if width is not None:  # the coefficients above `width`: zero moments and gradients (its contract)
            m0[:, width:] = 0.0
        v0 = m0.square() * 2
        for opt, param in ((a, pa), (b, pb)):
            opt.state[param].update(step=torch.tensor(0.0), exp_avg=m0.clone(), exp_avg_sq=v0.clone())
        for t in range(6):
            touched = torch.rand(n, generator=g) < 0.7
            rows = torch.nonzero(touched).flatten()
            scale = 10.0 ** torch.randint(-8, 2, (n,) + (1,) * len(shape), generator=g).float()
            wide = torch.zeros((n, 64), dtype=dtype)  # the update's sum: a parameter's columns are a strided slice
            cols = int(torch.Size(shape).numel())
            wide[:, 5:5 + cols] = (torch.randn((n,) + shape, generator=g, dtype=dtype) * scale).flatten(1) * touched[
                :, None]
            grad = wide[:, 5:5 + cols].reshape((n,) + shape)
            if width is not None:
                grad[:, width:] = 0.0
            before_a, after_a, _ = a.step_rows(rows, grad.index_select(0, rows), keep_before=True, width=width)
            before_b, after_b = b.step_touched(torch.nonzero(~touched).flatten(), grad, keep_before=True,
                                               width=width)
            assert torch.equal(before_b.index_select(0, rows), before_a) and torch.equal(
                after_b.index_select(0, rows), after_a)
            for x, y in ((pa.data, pb.data), (a.state[pa]["exp_avg"], b.state[pb]["exp_avg"]),
                         (a.state[pa]["exp_avg_sq"], b.state[pb]["exp_avg_sq"])):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32)), (shape, t)
        assert not torch.equal(pa.data, init)  # it trained


def test_step_touched_with_eps_zero_leaves_the_coefficients_past_width():
    """With eps 0 Adam on a coefficient of zero moments and gradient is 0 / 0: `step_touched` over every coefficient
    writes back those past `width` (no NaN), giving `step_rows`' bits."""
    g = torch.Generator().manual_seed(4)
    n, width = 40, 3
    init = torch.randn(n, 15, 3, generator=g)
    pa, pb = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    a, b = SelectiveAdam([pa], lr=1e-2, eps=0.0), SelectiveAdam([pb], lr=1e-2, eps=0.0)
    for t in range(3):
        touched = torch.arange(n) % 2 == t % 2
        grad = torch.zeros(n, 15, 3)
        grad[touched, :width] = torch.randn(int(touched.sum()), width, 3, generator=g)
        rows = torch.nonzero(touched).flatten()
        a.step_rows(rows, grad.index_select(0, rows), width=width)
        b.step_touched(torch.nonzero(~touched).flatten(), grad, width=width)
        for x, y in ((pa.data, pb.data), (a.state[pa]["exp_avg"], b.state[pb]["exp_avg"]),
                     (a.state[pa]["exp_avg_sq"], b.state[pb]["exp_avg_sq"])):
            assert not bool(y.isnan().any()) and torch.equal(x.view(torch.int32), y.view(torch.int32)), t
