"""Selective (visibility-masked) Adam: the owner-side update of Odin's synchronous reference.

Why not gsplat's: `gsplat.optimizers.SelectiveAdam` (gsplat >= 1.5) runs a CUDA kernel only; gsplat 1.4.0, which
nerfstudio 1.1.5 pins, does not have it at all; Odin must also run on the CPU, bit for bit.

The update, per parameter tensor p [N, ...] with gradient g, moments m, v (state "exp_avg", "exp_avg_sq") and the
row mask `visibility` [N] (True = some view of this step touched the Gaussian):

    t <- t + 1                                    (state "step": every call, for every parameter; see below)
    for every visible row i (all of its elements):
        m_i <- beta1 * m_i + (1 - beta1) * g_i    (computed as torch.lerp(m_i, g_i, 1 - beta1), as torch.optim.Adam)
        v_i <- beta2 * v_i + (1 - beta2) * g_i^2
        with bias correction (default):
            p_i <- p_i - (lr / (1 - beta1^t)) * m_i / (sqrt(v_i) / sqrt(1 - beta2^t) + eps)
        without (bias_correction=False, exactly gsplat's kernel `adam_kernel` in gsplat/cuda/csrc/AdamCUDA.cu):
            p_i <- p_i - lr * m_i / (sqrt(v_i) + eps)
    rows that are not visible: p_i, m_i, v_i unchanged (bit for bit).

gsplat's kernel applies *no* bias correction (its Python wrapper passes lr, betas and eps only, and its
state["step"] is never advanced). The default here keeps Adam's bias correction instead, with t the step count
of the parameter, so that (a) with every row visible this is torch.optim.Adam bit for bit, i.e. plain splatfacto
training is unchanged, and (b) the early updates have Adam's magnitude (gsplat's first update is
lr * (1 - beta1) / sqrt(1 - beta2) = 3.16 lr per element). `bias_correction=False` gives gsplat's update.

Step count. t advances on every `step()` call for every parameter, visible rows or not, gradient or not: t is the
global step count, identical on every owner whatever rows it holds, so an owner updating only its shard uses the
same bias correction as the single-process reference. (torch.optim.Adam skips a parameter whose .grad is None
without advancing its step; here such a parameter only has all rows treated as not visible.)

Determinism and sharding. The arithmetic is the same sequence of elementwise torch ops as torch.optim.Adam's
single-tensor path (lerp_, mul_/addcmul_, sqrt/div/add_, addcdiv_), applied to the visible rows only (gathered
with index_select, written back with index_copy_). Each element's result depends only on that element's values,
so updating a shard gives the same bits as updating the full tensor (tests/test_scene_selective_adam.py checks it).

The mask can be given as `step(visibility)` or, for callers that call `step()` with no argument (nerfstudio's
`Optimizers`, gsplat strategies, GradScaler), set beforehand as the attribute `optimizer.visibility`. The
attribute applies to one step: `step()` consumes it (resets it to None). No mask means every row is visible
(dense Adam), unless the optimizer was built with `require_visibility=True`, which makes a missing mask an error.

State layout is torch.optim.Adam's ("step" a float32 scalar tensor on the CPU, "exp_avg", "exp_avg_sq" like the
parameter), so `state_dict()` / `load_state_dict()` and gsplat's strategy ops (gsplat/strategy/ops.py, which
rewrite every state entry except "step" when duplicating, splitting or pruning rows) work unchanged.

Not supported: amsgrad, weight decay, maximize, sparse or complex gradients.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from odin_ns.buffers import kept_rows


class SelectiveAdam(torch.optim.Optimizer):
    """Adam that updates only the rows (Gaussians) marked visible; see the module docstring for the exact update.

    Args:
        params: parameters or param groups; each parameter's first dimension indexes Gaussians.
        lr, eps, betas: as torch.optim.Adam.
        bias_correction: Adam's bias correction (default) or gsplat's uncorrected kernel update.
        require_visibility: make `step()` without a mask an error instead of a dense update.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        eps: float = 1e-8,
        betas: Tuple[float, float] = (0.9, 0.999),
        bias_correction: bool = True,
        require_visibility: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        defaults = dict(lr=lr, eps=eps, betas=tuple(betas), bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.require_visibility = require_visibility
        self._counts: dict = {}  # id(step tensor) -> (the tensor, its value): see _advance
        self.visibility: Optional[Tensor] = None
        self._work: Optional[List[Tensor]] = None  # step_rows' buffers, kept between steps: see _buffers
        self._grad: Optional[Tensor] = None  # a narrow gradient made contiguous: see _begin_single
        self._kept_before: Optional[Tensor] = None  # the rows' values before a step: see _before

    @torch.no_grad()
    def step(self, visibility: Optional[Tensor] = None, closure: Optional[Callable[[], float]] = None):
        """One update. `visibility`: bool [N] (nonzero = visible); default: the `visibility` attribute."""
        if callable(visibility) and closure is None:  # torch's positional step(closure)
            visibility, closure = None, visibility
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if visibility is None:
            visibility = self.visibility
        self.visibility = None  # a mask describes one step
        if visibility is None and self.require_visibility:
            raise RuntimeError("SelectiveAdam.step(): no visibility mask given (require_visibility=True)")
        for group in self.param_groups:
            for p in group["params"]:
                self._update(p, group, visibility)
        return loss

    def _advance(self, state: dict) -> float:
        """Count one step in state["step"] and return the new count as a Python number, read from the tensor once
        and then kept beside it (keyed by the tensor itself, which moves with the state when a parameter is
        replaced): reading the tensor at every step would be a host read per parameter and step (it lives on the
        CPU, as torch.optim keeps it, even for CUDA parameters)."""
        tensor = state["step"]
        tensor += 1
        known = self._counts.get(id(tensor))
        value = known[1] + 1.0 if known is not None and known[0] is tensor else float(tensor.item())
        self._counts[id(tensor)] = (tensor, value)
        return value

    def _update(self, p: Tensor, group: dict, visibility: Optional[Tensor]) -> None:
        state = self._started(p)
        step = self._advance(state)
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse or torch.is_complex(p):
            raise RuntimeError("SelectiveAdam supports dense real gradients only")
        rows = None  # None = every row
        if visibility is not None:
            mask = visibility.reshape(-1).to(device=p.device) != 0
            if mask.shape[0] != p.shape[0]:
                raise ValueError(f"visibility has {mask.shape[0]} rows, the parameter {p.shape[0]}")
            if not bool(mask.all()):
                rows = torch.nonzero(mask).flatten()
                if rows.numel() == 0:
                    return
        lr, eps, (beta1, beta2) = group["lr"], group["eps"], group["betas"]
        if group["bias_correction"]:
            bias1, bias2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
        else:
            bias1, bias2_sqrt = 1.0, 1.0
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if rows is None:
            _adam_rows(p, grad, m, v, lr, beta1, beta2, eps, bias1, bias2_sqrt)
            return
        p_r, m_r, v_r = p.index_select(0, rows), m.index_select(0, rows), v.index_select(0, rows)
        _adam_rows(p_r, grad.index_select(0, rows), m_r, v_r, lr, beta1, beta2, eps, bias1, bias2_sqrt)
        p.index_copy_(0, rows, p_r)
        m.index_copy_(0, rows, m_r)
        v.index_copy_(0, rows, v_r)


    @torch.no_grad()
    def step_rows(self, rows: Tensor, grad: Tensor, keep_before: bool = False, width: Optional[int] = None
                  ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
        """One update of this optimizer's (single) parameter on the given rows only, with their gradient rows: the
        same arithmetic as `step(visibility)` with exactly those rows visible, without a gradient or a mask the
        size of the parameter (the owner's update touches what the step touched). The step count advances as in
        `step`. Returns the rows' values before (only if `keep_before`: a copy, valid until the next step), after,
        and their first moment after (a row whose first moment is all zero did not change: its step is zero).

        `width`: update only the first `width` entries of each row's second dimension (`grad` may have just those).
        The caller vouches that the others have a zero gradient and zero moments, where Adam is a no-op bit for bit
        (m and v stay 0, p moves by -lr * 0 / eps): the SH coefficients above the degree a step trains
        (`OwnerUpdate`)."""
        p, m, v, grad, (lr, eps, beta1, beta2, bias1, bias2_sqrt) = self._begin_single(grad, width)
        p_r, m_r, v_r, denom = self._buffers(p, rows.shape[0])
        if rows.shape[0] == p.shape[0] and rows.numel():  # every row (rows ascending, distinct): in place, no
            # gather; the same operations on the same values, element by element
            data = p.data
            before = self._before(data) if keep_before else None
            _adam_rows(data, grad, m, v, lr, beta1, beta2, eps, bias1, bias2_sqrt, denom)
            return before, data, m
        torch.index_select(p, 0, rows, out=p_r)
        torch.index_select(m, 0, rows, out=m_r)
        before = self._before(p_r) if keep_before else None
        if rows.numel() == 0:
            return before, p_r, m_r
        torch.index_select(v, 0, rows, out=v_r)
        _adam_rows(p_r, grad, m_r, v_r, lr, beta1, beta2, eps, bias1, bias2_sqrt, denom)
        p.index_copy_(0, rows, p_r)
        m.index_copy_(0, rows, m_r)
        v.index_copy_(0, rows, v_r)
        return before, p_r, m_r

    @torch.no_grad()
    def step_touched(self, touched: "Tensor | TouchedRows", grad: Tensor, keep_before: bool = False,
                     width: Optional[int] = None) -> Tuple[Optional[Tensor], Tensor]:
        """`step_rows` on the rows `touched` ([N] bool) marks, computed in place over every row: `grad` [N, ...]
        must be zero on the rows not touched. Adam's operations run with per-row factors that are Adam's own on a
        touched row and make it a no-op on the others: m <- lerp(m, g, 0) = m, v <- v * 1 + 0, p <- p + (-0.0) / denom
        = p (the step is made -0.0 there: 0 * m is a zero of m's sign, and +0.0 added to a -0.0 parameter makes it
        +0.0; m and v never hold -0.0, which Adam cannot make from zeros). A first moment that is not finite, which
        Adam does not make (its row's parameter would be NaN already) but a loaded state may hold, turns an untouched
        row's m and parameter NaN here (lerp with weight 0 is m + 0 * (g - m)), where `step_rows` leaves them; no
        other state differs. On a touched row the factors are the scalars Adam uses, rounded to
        the parameter's dtype as a scalar operand is, and the step is written m * s / denom, the order in which
        `addcdiv_` evaluates value * m / denom: the same bits in float32 and float64 (tested against `step_rows`;
        in half precision they differ, as they did before the narrow rows' masks). Where most rows are
        touched this saves the gathers and scatters of p, m and v. Returns the parameter's values before (a copy, if
        `keep_before`, valid until the next step) and after (the parameter itself). `touched` may come as the step's
        `TouchedRows`, whose factors the parameters of one step share."""
        p, m, v, grad, (lr, eps, beta1, beta2, bias1, bias2_sqrt) = self._begin_single(grad, width)
        mask = touched if isinstance(touched, TouchedRows) else TouchedRows(touched)
        denom, step_m = self._buffers(p, p.shape[0])[:2]
        before = self._before(p) if keep_before else None
        m.lerp_(grad, mask.factor(1 - beta1, 0.0, p))
        v.mul_(mask.factor(beta2, 1.0, p)).addcmul_(grad, grad, value=1 - beta2)
        _denominator(v, denom, bias2_sqrt, eps)
        torch.mul(m, mask.factor(-(lr / bias1), 0.0, p), out=step_m)
        mask.negative_zero_untouched(step_m)
        p.addcdiv_(step_m, denom)
        return before, p

    def _started(self, p: Tensor) -> dict:
        """`p`'s state, started as torch.optim.Adam starts it if it is new."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _begin_single(self, grad: Tensor, width: Optional[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor, tuple]:
        """For `step_rows` and `step_touched`: the single parameter's data, moments and `grad` (their first `width`
        entries of dimension 1), the state started if new and its step counted; the step's scalars (lr, eps, beta1,
        beta2, bias1, bias2_sqrt)."""
        (group,) = self.param_groups
        (p,) = group["params"]
        state = self._started(p)
        step = self._advance(state)
        self.visibility = None
        p, m, v = p.data, state["exp_avg"], state["exp_avg_sq"]
        if width is not None and width < p.shape[1]:
            p, m, v, grad = p[:, :width], m[:, :width], v[:, :width], grad[:, :width]
        if grad.device.type == "cpu" and not grad.is_contiguous() and grad.shape[1:].numel() < TouchedRows.NARROW:
            # a strided gradient of narrow rows (a parameter's columns of the update's sum) costs torch's CPU loops
            # ten to fifty times a contiguous one (lerp_ over [100k, 3] columns of [100k, 62], one thread: 1.8
            # against 0.04 ms), more than a copy (0.3 ms); wider rows are read as they are (elementwise operations
            # give the same bits whatever the strides)
            self._grad = kept_rows(self._grad, grad.shape[0], grad.shape[1:], grad.dtype, grad.device)
            grad = self._grad[:grad.shape[0]].copy_(grad)
        lr, eps, (beta1, beta2) = group["lr"], group["eps"], group["betas"]
        if group["bias_correction"]:
            bias1, bias2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
        else:
            bias1, bias2_sqrt = 1.0, 1.0
        return p, m, v, grad, (lr, eps, beta1, beta2, bias1, bias2_sqrt)

    def _before(self, values: Tensor) -> Tensor:
        """A copy of `values` in a buffer kept between steps (a fresh copy the size of a parameter costs its page
        faults on the CPU, about twice the copy): valid until this optimizer's next step, which writes it again."""
        self._kept_before = kept_rows(self._kept_before, values.shape[0], values.shape[1:], values.dtype,
                                      values.device)
        return self._kept_before[:values.shape[0]].copy_(values)

    def _buffers(self, p: Tensor, n: int) -> Tuple[Tensor, ...]:
        """Four contiguous [n, ...] buffers shaped like `p`'s rows (its rows, moments and Adam's denominator), kept
        between steps (`odin_ns.buffers`)."""
        self._work = [kept_rows(buf, n, p.shape[1:], p.dtype, p.device) for buf in self._work or [None] * 4]
        return tuple(buf[:n] for buf in self._work)


class TouchedRows:
    """A step's touched rows as `step_touched` uses them: the mask, and the per-row factors made once per step and
    shared by every parameter that needs the same ones (the moments' factors are the same for parameters with the
    same betas; the step's factor is each parameter's own).

    A factor is a view [N, 1, ...] broadcast over a row, except for rows of 2-7 elements (means, scales, quats,
    colours), where it is made out to the parameter's shape: torch's CPU loops broadcast a per-row
    operand over an inner dimension of 3 or 4 at about a tenth of their speed (lerp over [100k, 3], one thread:
    0.38 ms broadcast, 0.04 ms with a full operand), and over 45 columns at nearly full speed. Such a factor is
    made from a full-shape mask (1 on a touched row), one per shape and step, multiplied by the factor's values
    (0.04 ms, where making each factor out by a broadcast copy took 0.23)."""

    NARROW = 8  # rows of fewer elements take full-shape factors

    def __init__(self, touched: Tensor):
        self.touched = touched
        self._made: dict = {}

    def _kept(self, key: tuple, make: Callable[[], Tensor]) -> Tensor:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def _per_row(self, on, off, dtype: torch.dtype) -> Tensor:
        """[N] in `dtype`: `on` on a touched row, `off` on the others."""
        return self._kept(("row", repr(on), repr(off), dtype), lambda: torch.where(  # repr: -0.0 is not 0.0 here
            self.touched, torch.tensor(on, dtype=dtype), torch.tensor(off, dtype=dtype)))

    def _row_view(self, row: Tensor, like: Tensor) -> Tensor:
        return row.view((like.shape[0],) + (1,) * (like.dim() - 1))

    def _narrow(self, like: Tensor) -> bool:
        """Rows of 2 to NARROW - 1 elements (a row of one element takes the [N, 1] view as it is)."""
        return 1 < like.shape[1:].numel() < self.NARROW

    def _made_out(self, row: Tensor, like: Tensor) -> Tensor:
        """[N] made out to `like`'s shape, contiguous: a broadcast copy (kept by the caller)."""
        return self._row_view(row, like).expand(like.shape).contiguous()

    def _inside(self, like: Tensor) -> Tensor:
        """Shaped like `like`, contiguous, in its dtype: 1 on a touched row, 0 on the others."""
        return self._kept(("inside", tuple(like.shape), like.dtype), lambda: self._row_view(
            self.touched, like).expand(like.shape).to(like.dtype, memory_format=torch.contiguous_format))

    def _outside(self, like: Tensor) -> Tensor:
        """`_inside`'s complement: 1 on a row not touched."""
        return self._kept(("outside", tuple(like.shape), like.dtype), lambda: torch.sub(1, self._inside(like)))

    def factor(self, on: float, off: float, p: Tensor) -> Tensor:
        """Like `p` (see the class): `on` on a touched row, `off` on the others, in `p`'s dtype. A narrow shape's
        factor in float32 or float64 is made from the mask: mask * on, or (1 - mask) + mask * on where `off` is 1:
        exactly `on` and `off` (x * 1, x * 0 + 1 and 0 + x are exact; a Python scalar operand is rounded to the
        dtype as `torch.tensor(on, dtype)` rounds it), but for a zero `off`, which gets the sign of `on` (the
        step's zero on an untouched row is made -0.0 whatever its sign, `negative_zero_untouched`; the moments'
        factors are positive); any other narrow factor is the per-row value made out by a broadcast copy."""
        if not self._narrow(p):
            return self._row_view(self._per_row(on, off, p.dtype), p)

        def make() -> Tensor:
            if p.dtype not in (torch.float32, torch.float64) or off not in (0, 1):
                return self._made_out(self._per_row(on, off, p.dtype), p)
            if off == 0:
                return torch.mul(self._inside(p), on)
            return torch.add(self._outside(p), self._inside(p), alpha=on)
        return self._kept(("factor", repr(on), repr(off), tuple(p.shape), p.dtype), make)

    def negative_zero_untouched(self, step: Tensor) -> None:
        """`step`'s untouched rows, each a zero of either sign, made -0.0: in float32 by setting the sign bit (an OR
        with a per-row word, a fifth of the cost of `masked_fill_`'s broadcast mask over 45 columns); the bits of a
        touched row are left as they are."""
        if step.dtype != torch.float32:
            untouched = self._kept(("untouched",), lambda: ~self.touched)
            step.masked_fill_(self._kept(("untouched", tuple(step.shape)), lambda: self._made_out(untouched, step))
                              if self._narrow(step) else self._row_view(untouched, step), -0.0)
            return
        if not self._narrow(step):
            word = self._row_view(self._per_row(0, -2 ** 31, torch.int32), step)
        else:  # (1 - mask) * -2^31, exact in int32
            word = self._kept(("sign", tuple(step.shape)), lambda: self._outside(step).to(torch.int32).mul_(-2 ** 31))
        step.view(torch.int32).bitwise_or_(word)


def _adam_rows(p, g, m, v, lr, beta1, beta2, eps, bias1, bias2_sqrt, denom: Optional[Tensor] = None) -> None:
    """In place, every element: torch.optim.Adam's single-tensor update, op for op (torch/optim/adam.py).
    Without bias correction bias1 = bias2_sqrt = 1.0, and dividing by 1.0 is exact: gsplat's formula. `denom`: a
    buffer like `v` for the denominator (the same operations, written in place)."""
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.addcdiv_(m, _denominator(v, denom, bias2_sqrt, eps), value=-(lr / bias1))


def _denominator(v: Tensor, denom: Optional[Tensor], bias2_sqrt: float, eps: float) -> Tensor:
    """Adam's denominator sqrt(v) / bias2_sqrt + eps, as torch.optim.Adam computes it (sqrt, div_, add_), into
    `denom` (a new tensor if None). Not as one `addcdiv` with the two scalars as 0-dim tensors: the same bits in
    float32, but torch's CPU loops do not vectorize an operation with two broadcast operands (over [100k, 45] on
    one thread: 3.7 ms against 1.0 ms for `div_` and `add_` together)."""
    if denom is None:
        denom = v.sqrt()
    else:
        torch.sqrt(v, out=denom)
    return denom.div_(bias2_sqrt).add_(eps)
