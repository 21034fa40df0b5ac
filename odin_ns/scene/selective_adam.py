"""Selective (visibility-masked) Adam: the owner-side update of Odin's synchronous reference.

Why not gsplat's: `gsplat.optimizers.SelectiveAdam` (gsplat >= 1.5) runs a CUDA kernel only; gsplat 1.4.0, which
nerfstudio 1.1.5 pins, does not have it at all; Odin must also run on the CPU, bit for bit.

The update, per parameter tensor p [N, ...] with gradient g, moments m, v (state "exp_avg", "exp_avg_sq") and the
row mask `visibility` [N] (True = some view of this step touched the Gaussian):

    t <- t + 1                                    (state "step": every call, for every parameter; see below)
    for every visible row i (all of its elements):
        m_i <- beta1 * m_i + (1 - beta1) * g_i    (computed as m_i + (1 - beta1) * (g_i - m_i), as torch's kernel)
        v_i <- beta2 * v_i + (1 - beta2) * g_i^2
        with bias correction (default):
            p_i <- p_i - (lr / (1 - beta1^t)) * m_i / (sqrt(v_i) / sqrt(1 - beta2^t) + eps)
        without (bias_correction=False, the formula of gsplat's kernel `adam_kernel`, gsplat/cuda/csrc/AdamCUDA.cu):
            p_i <- p_i - lr * m_i / (sqrt(v_i) + eps)
    rows that are not visible: p_i, m_i, v_i unchanged (bit for bit).

gsplat's kernel applies *no* bias correction (its Python wrapper passes lr, betas and eps only, and its
state["step"] is never advanced). The default here keeps Adam's bias correction instead, with t the step count
of the parameter, so that (a) with every row visible this is torch.optim.Adam's update (its fused kernel's bits,
below), and (b) the early updates have Adam's magnitude (gsplat's first update is
lr * (1 - beta1) / sqrt(1 - beta2) = 3.16 lr per element). `bias_correction=False` gives gsplat's update.

Step count. t advances on every `step()` call for every parameter, visible rows or not, gradient or not: t is the
global step count, identical on every owner whatever rows it holds, so an owner updating only its shard uses the
same bias correction as the single-process reference. (torch.optim.Adam skips a parameter whose .grad is None
without advancing its step; here such a parameter only has all rows treated as not visible.)

Determinism and sharding. The arithmetic is torch's fused Adam kernel (`torch._fused_adam_`, what
`torch.optim.Adam(fused=True)` runs: one pass over p, g, m, v where the single-tensor path makes seven), applied
to the visible rows only (gathered with index_select, written back with index_copy_; or, where most rows are
visible, over every row with the others copied aside and written back). Each element's result depends only on
that element's values (on the CPU every element takes the kernel's vectorized path: `fused_adam_`), so updating a
shard gives the same bits as updating the full tensor (tests/test_scene_selective_adam.py checks it). With every
row visible on parameters that fill whole units of the kernel (16 floats), this is torch.optim.Adam(fused=True)
bit for bit; splatfacto's Adam on the CPU (the single-tensor path) rounds some elements differently.

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
        self._kept_before: Optional[Tensor] = None  # the rows' values before a step: see _before
        self._saved: Optional[List[Tensor]] = None  # step_touched's copies of the untouched rows

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
        hyper = _hyper(group, step)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if rows is None:
            fused_adam_(p.data, grad, m, v, *hyper)
            return
        self._gathered(p.data, m, v, rows, grad, hyper, keep_before=False, whole_grad=True)

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
        (m and v stay 0, p moves by -lr * 0 / eps, a zero of the sign that leaves p as it is): the SH coefficients
        above the degree a step trains (`OwnerUpdate`)."""
        p, m, v, grad, hyper = self._begin_single(grad, width)
        if rows.shape[0] == p.shape[0] and rows.numel() and width is None:  # every row (ascending, distinct): in
            # place, no gather; the same arithmetic, element by element
            before = self._before(p) if keep_before else None
            fused_adam_(p, grad, m, v, *hyper)
            return before, p, m
        return self._gathered(p, m, v, rows, grad, hyper, keep_before)

    @torch.no_grad()
    def step_touched(self, untouched: Tensor, grad: Tensor, keep_before: bool = False,
                     width: Optional[int] = None) -> Tuple[Optional[Tensor], Tensor]:
        """`step_rows` on every row but the `untouched` ones (indices), computed in place over every row: `grad`
        [N, ...] must be zero on the untouched rows. The untouched rows' parameters and moments are copied aside
        and written back after the update over every row (one call of the fused kernel; its result on a row that
        was touched depends on that row's values alone), so they stay as they were, bit for bit. Where most rows
        are touched this saves gathering and scattering the touched ones. `width`: as `step_rows` (the update runs
        over every coefficient, a no-op on those the caller vouches for; the values returned are narrowed to
        `width`). Returns the parameter's values before (a copy, if `keep_before`, valid until the next step) and
        after (the parameter itself). With eps 0, where Adam on a coefficient of zero moments and gradient is
        0 / 0, the coefficients past `width` are copied aside too and written back."""
        p, m, v, grad, hyper = self._begin_single(grad, None)
        narrow = width is not None and width < p.shape[1]
        eps = self.param_groups[0]["eps"]
        past = [x[:, width:].clone() for x in (p, m, v)] if narrow and eps == 0 else []
        n = untouched.shape[0]
        self._saved = [kept_rows(buf, n, p.shape[1:], p.dtype, p.device) for buf in self._saved or [None] * 3]
        saved = [buf[:n] for buf in self._saved]
        for source, buf in zip((p, m, v), saved):
            torch.index_select(source, 0, untouched, out=buf)
        before = self._before(p[:, :width] if narrow else p) if keep_before else None
        fused_adam_(p, grad, m, v, *hyper)
        for target, buf in zip((p, m, v), saved):
            target.index_copy_(0, untouched, buf)
        for target, kept in zip((p, m, v), past):
            target[:, width:] = kept
        return before, p[:, :width] if narrow else p

    def _gathered(self, p: Tensor, m: Tensor, v: Tensor, rows: Tensor, grad: Tensor, hyper: tuple,
                  keep_before: bool, whole_grad: bool = False) -> Tuple[Optional[Tensor], Tensor, Tensor]:
        """The update of `rows` of `p` (and its moments): gathered into buffers of whole units of the fused
        kernel (`fused_adam_`; the rows past the gathered ones zero, where Adam is a no-op), updated, written back.
        `grad`: the rows' gradients, or with `whole_grad` the parameter's (gathered here too). Returns the rows'
        values before (if `keep_before`), after, and their first moment after."""
        T = rows.shape[0]
        p_r, m_r, v_r, g_r = self._buffers(p, _whole_units(T, p))
        for source, buf in ((p, p_r), (m, m_r), (v, v_r)) + (((grad, g_r),) if whole_grad else ()):
            torch.index_select(source, 0, rows, out=buf[:T])
        if not whole_grad:
            g_r[:T].copy_(grad)
        if p_r.shape[0] > T:
            for buf in (p_r, m_r, v_r, g_r):
                buf[T:].zero_()
        before = self._before(p_r[:T]) if keep_before else None
        if T:
            fused_adam_(p_r, g_r, m_r, v_r, *hyper)
            p.index_copy_(0, rows, p_r[:T])
            m.index_copy_(0, rows, m_r[:T])
            v.index_copy_(0, rows, v_r[:T])
        return before, p_r[:T], m_r[:T]

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
        entries of dimension 1), the state started if new and its step counted; the step's arguments of
        `fused_adam_` (step, lr, beta1, beta2, eps)."""
        (group,) = self.param_groups
        (p,) = group["params"]
        state = self._started(p)
        step = self._advance(state)
        self.visibility = None
        p, m, v = p.data, state["exp_avg"], state["exp_avg_sq"]
        if width is not None and width < p.shape[1]:
            p, m, v, grad = p[:, :width], m[:, :width], v[:, :width], grad[:, :width]
        return p, m, v, grad, _hyper(group, step)

    def _before(self, values: Tensor) -> Tensor:
        """A copy of `values` in a buffer kept between steps (a fresh copy the size of a parameter costs its page
        faults on the CPU, about twice the copy): valid until this optimizer's next step, which writes it again."""
        self._kept_before = kept_rows(self._kept_before, values.shape[0], values.shape[1:], values.dtype,
                                      values.device)
        return self._kept_before[:values.shape[0]].copy_(values)

    def _buffers(self, p: Tensor, n: int) -> Tuple[Tensor, ...]:
        """Four contiguous [n, ...] buffers shaped like `p`'s rows (its rows, moments and gradient), kept between
        steps (`odin_ns.buffers`)."""
        self._work = [kept_rows(buf, n, p.shape[1:], p.dtype, p.device) for buf in self._work or [None] * 4]
        return tuple(buf[:n] for buf in self._work)


# Adam's step count for an update without bias correction: beta ** 2^62 is at most exp(-2^62 * 2^-53) = exp(-512)
# for every beta below 1 in double precision, far below half an ulp of 1.0, so the fused kernel's corrections
# 1 - beta ** step are 1.0 exactly and dividing by them is exact: gsplat's formula
UNCORRECTED_STEP = 2.0 ** 62


def _hyper(group: dict, step: float) -> tuple:
    """`fused_adam_`'s arguments after the tensors: the step count its bias correction uses, lr, betas, eps."""
    beta1, beta2 = group["betas"]
    return (step if group["bias_correction"] else UNCORRECTED_STEP, group["lr"], beta1, beta2, group["eps"])


def _unit(t: Tensor) -> int:
    """Elements in one unit of torch's fused CPU Adam: it splits its work in cache lines of 64 bytes, and within a
    whole unit every element takes the vectorized path (8 or 16 floats a vector: both divide 16)."""
    return 64 // t.element_size()


def _whole_units(rows: int, like: Tensor) -> int:
    """`rows` rounded up to a multiple of the fused kernel's unit on the CPU (`fused_adam_`), so that the rows'
    elements (rows of `like`'s shape) fill whole units whatever a row's size; on CUDA `rows`."""
    if like.device.type != "cpu":
        return rows
    unit = _unit(like)
    return -(-rows // unit) * unit


def fused_adam_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: float, lr: float, beta1: float, beta2: float,
                eps: float) -> None:
    """In place over every element of `p`, `m`, `v` (shaped alike; `g` its gradient): one Adam update as torch's
    fused kernel computes it (`torch._fused_adam_`, what `torch.optim.Adam(fused=True)` calls), with Adam's bias
    correction at step count `step`, in one pass over the four tensors where torch's single-tensor Adam makes
    seven (and about a tenth of the time on one CPU thread: 6 parameters of 20k rows, 0.8 against 8.6 ms).

    On the CPU the kernel's vectorized path and its scalar loop for a tensor's last elements round differently
    (the scalar loop's lerp is not a fused multiply-add), which would make a row's result depend on its place in
    the tensor: an owner's shard and one process's whole model would differ. So every element here goes through
    the vectorized path: the tensor's last elements that do not fill a unit are copied into a zero unit (where
    Adam is a no-op), updated there and copied back. Written by hand for that reason; torch's own call is left
    as it is. On CUDA the kernel computes every element alike and runs on the tensors as they are."""
    if p.numel() == 0:
        return
    tensors = [x if x.is_contiguous() else x.contiguous() for x in (p, g, m, v)]
    if p.device.type != "cpu":
        steps = [torch.full((), step, dtype=torch.float32, device=p.device)]
        torch._fused_adam_(*[[x] for x in tensors], [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0,
                           eps=eps, amsgrad=False, maximize=False)
    else:
        unit, n = _unit(p), p.numel()
        body = n - n % unit
        flat = [x.view(-1) for x in tensors]
        lists: List[List[Tensor]] = [[x[:body]] if body else [] for x in flat]
        tail = None
        if body < n:
            tail = [torch.zeros(unit, dtype=p.dtype) for _ in flat]
            for t, x in zip(tail, flat):
                t[:n - body].copy_(x[body:])
            for held, t in zip(lists, tail):
                held.append(t)
        steps = [torch.tensor(step, dtype=torch.float32)] * len(lists[0])
        torch._fused_adam_(*lists, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps,
                           amsgrad=False, maximize=False)
        if tail is not None:
            for t, x in zip(tail, flat):
                x[body:].copy_(t[:n - body])
    for x, y in zip((p, m, v), (tensors[0], tensors[2], tensors[3])):
        if x is not y:
            x.copy_(y)
