"""Front-to-back alpha compositing on CPU: gsplat's `rasterize_to_pixels` forward and backward.

Why by hand: gsplat's kernels are CUDA-only, and compositing through PyTorch autograd on CPU costs several times
more (every Gaussian-pixel pair would hold a graph node chain). This is the one place where the math of
gsplat's `rasterize_to_pixels_fwd.cu` / `_bwd.cu` is re-expressed, vectorized as dense blocks:

- work unit: a batch of up to `B` consecutive entries of a sub-tile's depth-sorted list against the sub-tile's
  P pixels, i.e. dense [T, P, B] tensors for T tiles at once (no per-pair gathers, scatters or sorts);
- per pixel, exactly gsplat's rules: power = 0.5 (a dx^2 + c dy^2) + b dx dy, alpha = min(0.999, o exp(-power)),
  skip when power < 0 or alpha < 1/255, stop before the Gaussian that would take the transmittance to
  <= 1e-4 (that one is not composited), T updated by sequential multiplication (a cumprod along B);
- backward walks the same batches back to front, carrying per pixel the sum over deeper Gaussians of
  w_j (c_j . dL/dC), which is all gsplat's per-pixel `buffer` is used for, recomputes each batch from the
  saved inputs (bit-identical to the forward) and reduces each (tile, entry) over the tile's pixels before one
  `index_add_` per gradient row into the entries;
- absgrad: per entry, the sum over pixels of |dL/dmeans2d| of that pixel, as gsplat's kernel accumulates it.

Every reduction runs in a fixed order (dense reductions of fixed shapes, `index_add_` on CPU loops over the
index serially), so identical inputs give bit-identical outputs and gradients at a fixed thread count.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .tiles import Isects

# Dense work per step (T * P * B elements): large tensors on this kind of machine pay page faults on every
# allocation; ~0.5M float32 elements (2 MiB) stay in cache and in malloc's reuse range.
_MAX_ELEMS = 1 << 19


class _Batch:
    __slots__ = ("tid", "ent", "jv", "g6", "cols", "T_in", "done_in")

    def __init__(self, tid, ent, jv, g6, cols, T_in, done_in):
        self.tid, self.ent, self.jv, self.g6, self.cols = tid, ent, jv, g6, cols
        self.T_in, self.done_in = T_in, done_in


def _alphas(b: _Batch, px: Tensor, py: Tensor):
    """Recomputable per-batch quantities; used identically by forward and backward (bit-identical)."""
    mx, my, ca, cb, cc, op = b.g6.unbind(0)  # each [T, B]
    dx = mx[:, None, :] - px[:, :, None]  # [T, P, B]; gsplat's delta = mean - pixel
    dy = my[:, None, :] - py[:, :, None]
    power = 0.5 * (ca[:, None, :] * dx * dx + cc[:, None, :] * dy * dy) + cb[:, None, :] * dx * dy
    vis = torch.exp(-power)
    ov = op[:, None, :] * vis
    alpha = ov.clamp_max(0.999)
    ok = (power >= 0) & (alpha >= 1.0 / 255.0) & ~b.done_in[:, :, None]
    alpha_v = torch.where(ok, alpha, 0.0)
    one_m = 1.0 - alpha_v
    # transmittance, exactly gsplat's sequence T <- T * (1 - alpha): Tcat[..., k] = T before entry k
    Tcat = torch.cumprod(torch.cat([b.T_in[:, :, None], one_m], dim=2), dim=2)
    stop = Tcat[:, :, 1:] <= 1e-4  # the entry that would push T to <= 1e-4 and all after it
    contrib = ok & ~stop
    return dx, dy, vis, ov, alpha_v, Tcat, stop, contrib


class RasterizeToPixelsCPU(torch.autograd.Function):
    """Same contract as gsplat's `_RasterizeToPixels`: entries [E, ...] -> (colors, alphas) [C, H, W, D|1]."""

    @staticmethod
    def forward(
        ctx,
        means2d: Tensor,  # [E, 2]
        conics: Tensor,  # [E, 3]
        colors: Tensor,  # [E, D]
        opacities: Tensor,  # [E]
        backgrounds: Optional[Tensor],  # [C, D]
        entry_cam: Tensor,  # [E]
        isects: Isects,
        batch: int,
        absgrad: bool,
        absgrad_target: Optional[Tensor],
    ) -> Tuple[Tensor, Tensor]:
        grid = isects.grid
        dtype = means2d.dtype
        E, D = colors.shape
        P = grid.P
        px_all, py_all, inside = grid.pixel_centers(dtype, means2d.device)
        attr = torch.cat([means2d.t(), conics.t(), opacities[None]], 0).contiguous()  # [6, E]
        cols = colors.contiguous()

        T_pix = torch.ones(grid.n_tiles, P, dtype=dtype)
        done = ~inside
        accum = torch.zeros(grid.n_tiles, P, D, dtype=dtype)
        batches: List[_Batch] = []
        arB = torch.arange(batch)

        active = (isects.lengths > 0).nonzero().squeeze(1)
        per_step = max(1, _MAX_ELEMS // (P * batch))
        for chunk in torch.split(active, per_step):
            tid = chunk
            j0 = 0
            T_c, d_c = T_pix[tid], done[tid]
            acc = torch.zeros(len(tid), P, D, dtype=dtype)
            start, length = isects.starts[tid], isects.lengths[tid]
            px, py = px_all[tid], py_all[tid]
            while True:
                jv = (j0 + arB)[None, :] < length[:, None]  # [T, B]
                jj = torch.where(jv, start[:, None] + j0 + arB[None, :], 0)
                ent = isects.entry[jj]  # [T, B]
                g6 = attr.index_select(1, ent.view(-1)).view(6, len(tid), batch)
                g6[5].mul_(jv)  # padding slots: opacity 0 never passes alpha >= 1/255
                cg = cols.index_select(0, ent.view(-1)).view(len(tid), batch, D)
                b = _Batch(tid, ent, jv, g6, cg, T_c, d_c)
                batches.append(b)
                _, _, _, _, alpha_v, Tcat, stop, contrib = _alphas(b, px, py)
                w = torch.where(contrib, alpha_v * Tcat[:, :, :batch], 0.0)
                acc.baddbmm_(w, cg)
                # T after this batch: value at the first stop (not composited) or at the end
                k = (~stop).sum(2, keepdim=True)
                T_c = Tcat.gather(2, k).squeeze(2)
                d_c = d_c | stop[:, :, -1]
                j0 += batch
                alive = (length > j0) & ~d_c.all(1)
                if bool(alive.all()):
                    continue
                fin = ~alive
                T_pix[tid[fin]] = T_c[fin]
                done[tid[fin]] = d_c[fin]
                accum[tid[fin]] = acc[fin]
                if not bool(alive.any()):
                    break
                tid, T_c, d_c, acc = tid[alive], T_c[alive], d_c[alive], acc[alive]
                start, length, px, py = start[alive], length[alive], px[alive], py[alive]

        bg_t = None
        if backgrounds is not None:
            bg_t = backgrounds.to(dtype)[torch.arange(grid.n_cameras).repeat_interleave(grid.tiles_per_cam)]
            out_t = accum + T_pix[:, :, None] * bg_t[:, None, :]
        else:
            out_t = accum
        render_colors = grid.tiles_to_image(out_t).contiguous()
        render_alphas = grid.tiles_to_image((1.0 - T_pix)[:, :, None]).contiguous()

        ctx.isects, ctx.batches, ctx.batch = isects, batches, batch
        ctx.absgrad, ctx.absgrad_target = absgrad, absgrad_target
        ctx.E, ctx.D = E, D
        ctx.has_bg = backgrounds is not None
        ctx.save_for_backward(T_pix, bg_t if bg_t is not None else torch.empty(0), render_alphas)
        return render_colors, render_alphas

    @staticmethod
    def backward(ctx, v_colors: Tensor, v_alphas: Tensor):
        T_pix, bg_t, render_alphas = ctx.saved_tensors
        isects, batch = ctx.isects, ctx.batch
        grid = isects.grid
        dtype = T_pix.dtype
        E, D = ctx.E, ctx.D
        px_all, py_all, _ = grid.pixel_centers(dtype, T_pix.device)

        G = grid.image_to_tiles(v_colors.to(dtype))  # [n_tiles, P, D]
        gA = grid.image_to_tiles(v_alphas.to(dtype))[:, :, 0]  # [n_tiles, P]
        if ctx.has_bg:
            bgg = (G * bg_t[:, None, :]).sum(2)
            Q = T_pix * (gA - bgg)
        else:
            Q = T_pix * gA
        carry = torch.zeros_like(T_pix)  # per pixel: sum over deeper entries of w_j (c_j . g)

        n_rows = 8 if ctx.absgrad else 6
        acc = torch.zeros(n_rows, E + 1, dtype=dtype)  # last column: sink for padding slots
        acc_c = torch.zeros(E + 1, D, dtype=dtype)

        for b in reversed(ctx.batches):
            tid = b.tid
            Tn = len(tid)
            px, py = px_all[tid], py_all[tid]
            dx, dy, vis, ov, alpha_v, Tcat, stop, contrib = _alphas(b, px, py)
            T_before = Tcat[:, :, :batch]
            w = torch.where(contrib, alpha_v * T_before, 0.0)
            g = G[tid]  # [T, P, D]
            cgd = torch.bmm(g, b.cols.transpose(1, 2))  # [T, P, B]: c_j . g
            wcg = w * cgd
            tot = wcg.sum(2)
            S = (tot + carry[tid])[:, :, None] - torch.cumsum(wcg, 2)  # sum over deeper entries
            carry[tid] += tot
            ra = 1.0 / (1.0 - alpha_v)
            v_alpha = T_before * cgd + (Q[tid][:, :, None] - S) * ra
            m = contrib & (ov <= 0.999)  # gsplat: no alpha gradient where clamped to 0.999
            vs = torch.where(m, -ov * v_alpha, 0.0)  # dL/dpower
            vdx, vdy = vs * dx, vs * dy
            mx, my, ca, cb, cc, op = b.g6.unbind(0)
            Sx, Sy = vdx.sum(1), vdy.sum(1)  # [T, B]
            rows = [
                ca * Sx + cb * Sy,  # dL/dmean_x
                cb * Sx + cc * Sy,  # dL/dmean_y
                0.5 * (vdx * dx).sum(1),  # dL/dconic_a
                (vdx * dy).sum(1),  # dL/dconic_b
                0.5 * (vdy * dy).sum(1),  # dL/dconic_c
                torch.where(m, vis * v_alpha, 0.0).sum(1),  # dL/dopacity
            ]
            if ctx.absgrad:
                rows.append((ca[:, None, :] * vdx + cb[:, None, :] * vdy).abs().sum(1))
                rows.append((cb[:, None, :] * vdx + cc[:, None, :] * vdy).abs().sum(1))
            idx = torch.where(b.jv, b.ent, E).view(-1)
            acc.index_add_(1, idx, torch.stack(rows, 0).view(n_rows, -1))
            acc_c.index_add_(0, idx, torch.bmm(w.transpose(1, 2), g).view(Tn * batch, D))

        v_means2d = acc[0:2, :E].t()
        v_conics = acc[2:5, :E].t()
        v_opac = acc[5, :E]
        v_cols = acc_c[:E]
        if ctx.absgrad and ctx.absgrad_target is not None:
            ctx.absgrad_target.absgrad = acc[6:8, :E].t().reshape(ctx.absgrad_target.shape)
        v_bg = None
        if ctx.has_bg and ctx.needs_input_grad[4]:
            v_bg = (v_colors * (1.0 - render_alphas)).sum(dim=(1, 2))
        return v_means2d, v_conics, v_cols, v_opac, v_bg, None, None, None, None, None
