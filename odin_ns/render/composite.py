"""Front-to-back alpha compositing on CPU: gsplat's `rasterize_to_pixels` forward and backward.

Why by hand: gsplat's kernels are CUDA-only, and compositing through PyTorch autograd on CPU costs several times
more (every Gaussian-pixel pair would hold a chain of graph nodes). This is the one place where the math of
gsplat's `rasterize_to_pixels_fwd.cu` / `_bwd.cu` is re-expressed, vectorized as dense blocks:

- work unit ("step"): for T sub-tiles at once, the next `B` entries of each sub-tile's depth-sorted list against
  the sub-tile's P pixels, as dense [T, P, B] tensors (no per-pair gathers, scatters or sorts);
- per pixel, gsplat's rules: power = 0.5 (a dx^2 + c dy^2) + b dx dy, alpha = min(0.999, o exp(-power)),
  skip when power < 0 or alpha < 1/255, stop before the Gaussian that would take the transmittance to
  <= 1e-4 (that one is not composited), T multiplied front to back (a cumprod along B);
- backward walks the same steps back to front, carrying per pixel the sum over deeper Gaussians of
  w_j (c_j . dL/dC), which is all gsplat's per-pixel `buffer` is needed for; each step is recomputed from its
  saved inputs with the same code as the forward (bit-identical decisions), reduced over the tile's pixels,
  and added into per-entry rows with one `index_add_`;
- absgrad: per entry, the sum over pixels of |dL/dmeans2d| of each pixel, as gsplat's kernel accumulates it.

Speed notes (2 cores, measured): temporaries above ~512 KiB page-fault on every allocation (glibc trims its heap),
so steps hold at most `_MAX_ELEMS` elements and reuse a per-thread workspace through `out=` / in-place ops;
`torch.where` with a scalar and bool-mask products are several times slower than arithmetic here, so 0/1 masks
are made with `clamp((x - threshold) * 1e30, 0, 1)`, exact because the subtraction keeps the sign of x - threshold.

Determinism: every reduction has a fixed order for fixed inputs (dense reductions of fixed shapes; `index_add_`
on CPU loops over its index in order), so identical inputs give bit-identical outputs and gradients.
"""

from __future__ import annotations

import math
import threading
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .tiles import Isects

_MAX_ELEMS = 1 << 17
_BIG = 1e30
_POWER_CAP = 60.0


class _Consts:
    """gsplat's thresholds as the comparisons see them in the working dtype."""

    _cache: dict = {}

    @classmethod
    def of(cls, dtype: torch.dtype) -> "_Consts":
        if dtype not in cls._cache:
            cls._cache[dtype] = cls(dtype)
        return cls._cache[dtype]

    def __init__(self, dtype: torch.dtype) -> None:
        def t(v):
            return torch.tensor(v, dtype=dtype)

        # alpha < 1/255 is skipped (float compare in gsplat): keep alpha > prev(1/255)
        self.alpha_prev = torch.nextafter(t(1.0 / 255.0), t(-1.0)).item()
        # next_T <= 1e-4 stops: T survives iff T > (largest value <= 1e-4)
        lo = t(1e-4)
        if lo.item() > 1e-4:
            lo = torch.nextafter(lo, t(-1.0))
        self.stop_lo = lo.item()
        self.amax = t(0.999).item()  # alpha = min(0.999, o * vis)
        # gradient flows through alpha iff o * vis <= 0.999: keep o * vis < next(0.999)
        self.unclamped_next = torch.nextafter(t(0.999), t(2.0)).item()


class _Workspace(threading.local):
    """Per-thread reusable buffers (forward and backward may run on different threads, e.g. a viewer)."""

    def __init__(self) -> None:
        self.bufs = {}

    def get(self, name: str, shape, dtype: torch.dtype) -> Tensor:
        """The buffer's first elements as a contiguous tensor of `shape`: made by `as_strided` (1.6 us a call
        where slicing and `view` take 3.5; a fwd+bwd of 10k Gaussians at 128x96 makes about 600 calls)."""
        n = math.prod(shape)
        key = (name, dtype)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, _MAX_ELEMS + (_MAX_ELEMS // 16)), dtype=dtype)
            self.bufs[key] = buf
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        return buf.as_strided(shape, strides[::-1])


_WS = _Workspace()


class _Step:
    """One step's saved inputs: tiles, their entries [T, B] and the per-pixel state when the step began."""

    __slots__ = ("tid", "idx", "g6", "cT", "T_in", "risky")

    def __init__(self, tid, idx, g6, cT, T_in, risky):
        self.tid, self.idx, self.g6, self.cT, self.T_in, self.risky = tid, idx, g6, cT, T_in, risky


def _alphas(st: _Step, px: Tensor, py: Tensor, k: _Consts):
    """Per-step quantities shared by forward and backward (same code, hence bit-identical results).

    Returns workspace views: dx, dy, vis, ov (o * vis), alpha (0 where skipped), Tcat (T before entry j at
    [..., j], T after the last at [..., B]), ns (1 where the pixel has not stopped after entry j), w.
    """
    T, P = px.shape
    B = st.g6.shape[2]
    dt = px.dtype
    sh = (T, P, B)
    mx, my, ca, cb, cc, op = (v[:, None, :] for v in st.g6.unbind(0))
    dx = torch.sub(mx, px[:, :, None], out=_WS.get("dx", sh, dt))  # gsplat's delta = mean - pixel
    dy = torch.sub(my, py[:, :, None], out=_WS.get("dy", sh, dt))
    pw = torch.mul(ca, dx, out=_WS.get("pw", sh, dt)).mul_(dx)
    t = torch.mul(cc, dy, out=_WS.get("t", sh, dt)).mul_(dy)
    pw.add_(t).mul_(0.5)
    pw.add_(torch.mul(cb, dx, out=t).mul_(dy))
    # exp(-power) of far pixels would underflow to denormals, which are ~10x slower on every op that touches
    # them; beyond power 60 alpha is < 1/255 anyway (skipped), so the cap changes no decision and no gradient
    vis = torch.clamp_max(pw, _POWER_CAP, out=_WS.get("vis", sh, dt)).neg_().exp_()
    ov = torch.mul(op, vis, out=_WS.get("ov", sh, dt))
    alpha = torch.clamp_max(ov, k.amax, out=_WS.get("alpha", sh, dt))
    m = torch.sub(alpha, k.alpha_prev, out=t).mul_(_BIG).clamp_(0.0, 1.0)
    if st.risky:
        # power < 0 only happens (by rounding) for near-singular conics; gsplat skips those pixels
        m.mul_(pw >= 0)
    alpha.mul_(m)
    Tcat = _WS.get("Tcat", (T, P, B + 1), dt)
    Tcat[:, :, 0] = st.T_in
    Tcat[:, :, 1:].copy_(alpha).neg_().add_(1.0)
    Tcat.cumprod_(2)
    ns = torch.sub(Tcat[:, :, 1:], k.stop_lo, out=_WS.get("ns", sh, dt)).mul_(_BIG).clamp_(0.0, 1.0)
    w = torch.mul(alpha, Tcat[:, :, :B], out=_WS.get("w", sh, dt)).mul_(ns)
    return dx, dy, vis, ov, alpha, Tcat, ns, w


class RasterizeToPixelsCPU(torch.autograd.Function):
    """Same contract as gsplat's `_RasterizeToPixels`, on flattened entries [E, ...] -> [C, H, W, D|1]."""

    @staticmethod
    def forward(
        ctx,
        means2d: Tensor,  # [E, 2]
        conics: Tensor,  # [E, 3]
        colors: Tensor,  # [E, D]
        opacities: Tensor,  # [E]
        backgrounds: Optional[Tensor],  # [C, D]
        isects: Isects,
        batch: int,
        absgrad: bool,
        absgrad_target: Optional[Tensor],
    ) -> Tuple[Tensor, Tensor]:
        grid = isects.grid
        dt = means2d.dtype
        E, D = colors.shape
        P = grid.P
        k = _Consts.of(dt)
        keep_steps = any(ctx.needs_input_grad[:5])
        px_all, py_all, inside = grid.pixel_centers(dt, means2d.device)
        attr = torch.cat([means2d.t(), conics.t(), opacities[None]], 0).contiguous()  # [6, E]
        colsT = colors.t().contiguous()  # [D, E]

        T_pix = torch.ones(grid.n_tiles, P, dtype=dt)
        done = ~inside
        accum = torch.zeros(grid.n_tiles, D, P, dtype=dt)
        steps: List[_Step] = []

        # tiles with similar list lengths share steps, so a step's B fits them
        active = (isects.lengths > 0).nonzero().squeeze(1)
        active = active[torch.sort(isects.lengths[active], stable=True).indices]
        per_step = max(1, _MAX_ELEMS // (P * batch))
        for tid in torch.split(active, per_step) if len(active) else ():
            start, length = isects.starts.index_select(0, tid), isects.lengths.index_select(0, tid)
            px, py = px_all.index_select(0, tid), py_all.index_select(0, tid)
            T_c, d_c = T_pix.index_select(0, tid), done.index_select(0, tid)
            acc = torch.zeros(len(tid), D, P, dtype=dt)
            j0 = 0
            while True:
                rem = int(length.max()) - j0
                B = -(-rem // -(-rem // batch))  # balanced batches of at most `batch`
                arB = torch.arange(j0, j0 + B)
                jv = arB[None, :] < length[:, None]  # [T, B]
                idx = torch.where(jv, start[:, None] + arB[None, :], 0).view(-1)
                ent = isects.entry.index_select(0, idx)
                g6 = attr.index_select(1, ent).view(6, len(tid), B)
                g6[5].mul_(jv)  # padding slots: opacity 0 never passes alpha >= 1/255
                cT = colsT.index_select(1, ent).view(D, len(tid), B).transpose(0, 1).contiguous()
                risky = isects.risky is not None and bool(isects.risky.index_select(0, ent).any())
                st = _Step(tid, torch.where(jv.view(-1), ent, E), g6, cT, T_c.masked_fill(d_c, 0.0), risky)
                if keep_steps:
                    steps.append(st)
                _, _, _, _, _, Tcat, ns, w = _alphas(st, px, py, k)
                acc.baddbmm_(cT, w.transpose(1, 2))
                # T after this step: at the first stopped entry (not composited) or after the last one
                kk = ns.sum(2, keepdim=True).long()
                T_c = torch.where(d_c, T_c, Tcat.gather(2, kk).squeeze(2))
                d_c = d_c | (ns[:, :, -1] == 0)
                j0 += B
                alive = (length > j0) & ~d_c.all(1)
                n_alive = int(alive.sum())
                if n_alive == 0:
                    T_pix.index_copy_(0, tid, T_c)
                    done.index_copy_(0, tid, d_c)
                    accum.index_copy_(0, tid, acc)
                    break
                if n_alive > 0.8 * len(tid):
                    continue  # finished tiles ride along (they no longer change) until enough are done
                fin = (~alive).nonzero().squeeze(1)
                tf = tid.index_select(0, fin)
                T_pix.index_copy_(0, tf, T_c.index_select(0, fin))
                done.index_copy_(0, tf, d_c.index_select(0, fin))
                accum.index_copy_(0, tf, acc.index_select(0, fin))
                keep = alive.nonzero().squeeze(1)
                tid, T_c, d_c, acc = (v.index_select(0, keep) for v in (tid, T_c, d_c, acc))
                start, length, px, py = (v.index_select(0, keep) for v in (start, length, px, py))

        out_t = accum.transpose(1, 2)
        bg_t = None
        if backgrounds is not None:
            bg_t = backgrounds.to(dt)[torch.arange(grid.n_cameras).repeat_interleave(grid.tiles_per_cam)]
            out_t = out_t + T_pix[:, :, None] * bg_t[:, None, :]
        render_colors = grid.tiles_to_image(out_t).contiguous()
        render_alphas = grid.tiles_to_image((1.0 - T_pix)[:, :, None]).contiguous()

        ctx.isects, ctx.steps, ctx.consts = isects, steps, k
        ctx.absgrad, ctx.absgrad_target = absgrad, absgrad_target
        ctx.E, ctx.D = E, D
        ctx.has_bg = backgrounds is not None
        ctx.save_for_backward(
            T_pix, bg_t if bg_t is not None else torch.empty(0), render_alphas, conics.detach(), opacities.detach()
        )
        return render_colors, render_alphas

    @staticmethod
    def backward(ctx, v_colors: Tensor, v_alphas: Tensor):
        T_pix, bg_t, render_alphas, conics, opacities = ctx.saved_tensors
        grid = ctx.isects.grid
        k = ctx.consts
        dt = T_pix.dtype
        E, D = ctx.E, ctx.D
        px_all, py_all, _ = grid.pixel_centers(dt, T_pix.device)

        G = grid.image_to_tiles(v_colors.to(dt)).contiguous()  # [n_tiles, P, D]
        gA = grid.image_to_tiles(v_alphas.to(dt))[:, :, 0]  # [n_tiles, P]
        if ctx.has_bg:
            Q = T_pix * (gA - (G * bg_t[:, None, :]).sum(2))
        else:
            Q = T_pix * gA
        carry = torch.zeros_like(T_pix)  # per pixel: sum over deeper entries of w_j (c_j . g)

        n_rows = 8 if ctx.absgrad else 6
        acc = torch.zeros(n_rows, E + 1, dtype=dt)  # last column: sink for padding slots
        acc_c = torch.zeros(D, E + 1, dtype=dt)

        for st in reversed(ctx.steps):
            tid = st.tid
            Tn, B = st.g6.shape[1], st.g6.shape[2]
            sh = (Tn, grid.P, B)
            px, py = px_all.index_select(0, tid), py_all.index_select(0, tid)
            dx, dy, _, ov, alpha, Tcat, ns, w = _alphas(st, px, py, k)
            g = G.index_select(0, tid)  # [T, P, D]
            cg = torch.bmm(g, st.cT, out=_WS.get("cg", sh, dt))  # c_j . g per pixel
            wcg = torch.mul(w, cg, out=_WS.get("wcg", sh, dt))
            tot = wcg.sum(2)
            c_old = carry.index_select(0, tid)
            carry.index_copy_(0, tid, c_old + tot)
            # Q - S_j, with S_j = sum over deeper entries of w (c . g) = (tot + carry) - prefix_j
            qs = torch.cumsum(wcg, 2, out=_WS.get("qs", sh, dt))
            qs.add_((Q.index_select(0, tid) - tot - c_old)[:, :, None])
            ra = torch.neg(alpha, out=_WS.get("ra", sh, dt)).add_(1.0).reciprocal_()
            va = torch.mul(Tcat[:, :, :B], cg, out=cg).addcmul_(qs, ra)  # dL/dalpha
            # gradient only where composited and not clamped at 0.999 (gsplat: o * vis <= 0.999)
            uc = torch.neg(ov, out=ra).add_(k.unclamped_next).mul_(_BIG).clamp_(0.0, 1.0)
            nv = va.mul_(alpha).mul_(ns).mul_(uc)  # = -dL/dpower
            t1 = torch.mul(nv, dx, out=_WS.get("t1", sh, dt))
            t2 = torch.mul(nv, dy, out=_WS.get("t2", sh, dt))
            rows = _WS.get("rows", (n_rows, Tn, B), dt)
            if ctx.absgrad:
                ca, cb, cc = (v[:, None, :] for v in st.g6[2:5].unbind(0))
                u = _WS.get("u", sh, dt)
                torch.sum(torch.mul(t1, ca, out=u).addcmul_(t2, cb).abs_(), 1, out=rows[6])
                torch.sum(torch.mul(t1, cb, out=u).addcmul_(t2, cc).abs_(), 1, out=rows[7])
            torch.sum(t1, 1, out=rows[0])
            torch.sum(t2, 1, out=rows[1])
            torch.sum(torch.mul(t1, dy, out=ov), 1, out=rows[3])
            torch.sum(t1.mul_(dx), 1, out=rows[2])
            torch.sum(t2.mul_(dy), 1, out=rows[4])
            torch.sum(nv, 1, out=rows[5])
            acc.index_add_(1, st.idx, rows.view(n_rows, -1))
            vc = torch.bmm(g.transpose(1, 2), w)  # [T, D, B]: sum over pixels of w g
            acc_c.index_add_(1, st.idx, vc.transpose(0, 1).reshape(D, -1))

        # per-entry rows -> gradients: power's gradient is linear in the entry's conic and opacity
        ca, cb, cc = conics.unbind(1)
        sx, sy = acc[0, :E], acc[1, :E]
        v_means2d = torch.stack([-(ca * sx + cb * sy), -(cb * sx + cc * sy)], 1)
        v_conics = torch.stack([-0.5 * acc[2, :E], -acc[3, :E], -0.5 * acc[4, :E]], 1)
        v_opac = acc[5, :E] / torch.where(opacities > 0, opacities, torch.ones_like(opacities))
        v_cols = acc_c[:, :E].t()
        if ctx.absgrad and ctx.absgrad_target is not None:
            ctx.absgrad_target.absgrad = acc[6:8, :E].t().reshape(ctx.absgrad_target.shape)
        v_bg = None
        if ctx.has_bg and ctx.needs_input_grad[4]:
            v_bg = (v_colors * (1.0 - render_alphas)).sum(dim=(1, 2))
        return v_means2d, v_conics, v_cols, v_opac, v_bg, None, None, None, None
