"""A view's projection of some Gaussians, and the backward of its splats' gradients through it.

An owner projects the rows of its blocks that views read (its own views and its readers', in one call for a step),
and turns the splats' gradients into each view's contribution when they come back: through the graph it kept, or
through the same projection made again with a graph (`keep_graph=False` the first time; a graph holds about three
times the projected rows' parameters, more than the owned rows with their moments when every view reads most of
them). The projection of a Gaussian does not depend on which others share the call (render/projection.py), so
the contributions are the same, bit for bit, whatever the rank count and whichever views share a call.

A contribution is [M, D + 3]: the gradient of each of the M rows' packed parameters, then gsplat's densification
statistics of the row in this view (DefaultStrategy's `_update_state`: the norm of the screen-space gradient
scaled by half the image size, visible 0/1, the radius over the larger image side).
"""

from __future__ import annotations

import contextlib
from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import MEANS2D, project_splats
from odin_ns.runtime.sharded import PARAM_NAMES, unpack_params


class ViewProjection(NamedTuple):
    """What an owner keeps of a view's projection until the splats' gradients come back."""

    leaves: Dict[str, torch.Tensor]  # [M, ...] the rows' parameters (autograd leaves; empty without a graph)
    ids: torch.Tensor  # [n] which of the M rows are visible (ascending)
    radii: torch.Tensor  # [n] int32
    splats: torch.Tensor  # [n, SPLAT_WIDTH], the graph back to the leaves (if kept)
    sizes: torch.Tensor  # [n or 1, 2] the image size (width, height) of each splat's view
    graph_bytes: int  # what the graph holds: its leaves and the tensors its backward reads (distinct storages)


Rows = Union[torch.Tensor, Dict[str, torch.Tensor]]


def project_rows(rows: Rows, num_rest: int, cams: RowCameras, sh_degree: Optional[int],
                 antialiased: bool, keep_graph: bool = True) -> ViewProjection:
    """Project rows, each in its camera (one for all rows, or one per row: an owner projects for every view that
    reads its blocks at a step in one call): packed rows [M, D] (a copy is made: the leaves), or the six
    parameters' rows as the caller gathered them for this projection (they become the leaves: no copy)."""
    with _graph(keep_graph) as held:
        leaves = _leaves(rows, num_rest, keep_graph)
        ids, radii, splats = _project(leaves, cams, sh_degree, antialiased)
    return ViewProjection(leaves if keep_graph else {}, ids, radii, splats, cams.rows(ids).sizes.to(splats.dtype),
                          held.total(leaves) if keep_graph else 0)


def _leaves(rows: Rows, num_rest: int, keep_graph: bool = True) -> Dict[str, torch.Tensor]:
    if isinstance(rows, dict):  # gathered for this projection, the caller's to give
        return {n: rows[n].requires_grad_() for n in PARAM_NAMES} if keep_graph else rows
    params = unpack_params(rows, num_rest)
    return {n: t.clone().requires_grad_() for n, t in params.items()} if keep_graph else params


def rows_device(rows: Rows) -> torch.device:
    return rows["means"].device if isinstance(rows, dict) else rows.device


class _Held:
    """The distinct storages a graph saves for its backward, counted as it is built (a saved-tensors hook)."""

    def __init__(self) -> None:
        self.storages: Dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def total(self, leaves: Dict[str, torch.Tensor]) -> int:
        for t in leaves.values():
            self.pack(t)
        return sum(self.storages.values())


@contextlib.contextmanager
def _graph(keep: bool):
    """A projection with its graph (what it saves counted) or without one (no autograd at all)."""
    held = _Held()
    if keep:
        with torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t):
            yield held
    else:
        with torch.no_grad():
            yield held


def _project(params: Dict[str, torch.Tensor], cams: RowCameras, sh_degree: Optional[int], antialiased: bool):
    coeffs = torch.cat([params["features_dc"][:, None, :], params["features_rest"]], dim=1)
    if sh_degree is None:
        coeffs = coeffs[:, :1]
    return project_splats(params["means"], params["quats"], params["scales"], params["opacities"], coeffs, cams,
                          sh_degree, antialiased)


def project_views(packed: Rows, num_rest: int, cams: Sequence[tuple], per_view: Sequence[int],
                  sh_degree: Optional[int], antialiased: bool, per_call: Optional[bool] = None,
                  keep_graph: bool = True) -> Tuple[ViewProjection, torch.Tensor]:
    """Project rows (`project_rows`'s two forms) that are consecutive runs of `per_view[k]` rows, each run in
    camera `cams[k]` ((viewmat [4, 4], K [3, 3], W, H)), as one projection; and each row's run. On the CPU one
    call with a camera per row; on CUDA (or with `per_call`) gsplat's kernels take one camera for all rows: one call
    per view, on slices of the same leaves (so every parameter's gradient reaches them), concatenated.
    `keep_graph=False`: the splats only (the same values), for a projection made again with its graph before its
    backward."""
    device = rows_device(packed)
    total = sum(per_view)
    run_of_row = torch.repeat_interleave(torch.arange(len(per_view)), torch.tensor(list(per_view), dtype=torch.int64),
                                         output_size=total).to(device)
    stack = (torch.stack([c[0] for c in cams]), torch.stack([c[1] for c in cams]),
             torch.tensor([[float(c[2]), float(c[3])] for c in cams], device=device))
    if per_call is None:
        per_call = device.type != "cpu"
    if len(cams) <= 1:
        return project_rows(packed, num_rest, RowCameras(*stack), sh_degree, antialiased, keep_graph), run_of_row
    if not per_call:  # a camera per row; its position inverted once per view (the values a row's inversion gives)
        positions = torch.inverse(stack[0])[:, :3, 3]
        row_cams = RowCameras(*(t.index_select(0, run_of_row) for t in (*stack, positions)))
        return project_rows(packed, num_rest, row_cams, sh_degree, antialiased, keep_graph), run_of_row
    ids, radii, splats, sizes, start = [], [], [], [], 0
    with _graph(keep_graph) as held:
        leaves = _leaves(packed, num_rest, keep_graph)
        for k, n in enumerate(per_view):
            cam = RowCameras(stack[0][k:k + 1], stack[1][k:k + 1], stack[2][k:k + 1])
            i, r, s = _project({name: t[start:start + n] for name, t in leaves.items()}, cam, sh_degree,
                               antialiased)
            ids.append(i + start)
            radii.append(r)
            splats.append(s)
            sizes.append(stack[2][k:k + 1].to(s.dtype).expand(i.shape[0], 2))
            start += n
        splats = torch.cat(splats)
    return ViewProjection(leaves if keep_graph else {}, torch.cat(ids), torch.cat(radii), splats, torch.cat(sizes),
                          held.total(leaves) if keep_graph else 0), run_of_row


def screen_grad_norm(g2d: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """gsplat's DefaultStrategy statistic of a splat in a view: the norm of its screen-space gradient [n, 2] scaled
    by half the view's image size (`sizes`: [n or 1, 2], width and height). The reader computes it from the
    absolute gradients its render accumulated (one number travels where two would) and the owner from the splat
    gradients: the same operations either way."""
    w, h = sizes[:, 0], sizes[:, 1]
    gx, gy = g2d[:, 0] * (w / 2.0), g2d[:, 1] * (h / 2.0)  # gsplat's scale, one camera per view
    return torch.sqrt(gx * gx + gy * gy)


def backprop(view: ViewProjection, grads: torch.Tensor, norm2d: Optional[torch.Tensor]) -> torch.Tensor:
    """The view's contribution from its splats' gradients [n, SPLAT_WIDTH] (and, when the strategy uses absolute
    gradients, their statistic [n] as `screen_grad_norm` gives it): the backward through the projection, then the
    statistics."""
    leaves = view.leaves
    if view.splats.shape[0]:
        torch.autograd.backward(view.splats, grads)
    m = leaves["means"].shape[0]
    widths = [leaves[n][0].numel() if m else (3 * leaves[n].shape[1] if n == "features_rest" else leaves[n].shape[-1])
              for n in PARAM_NAMES]
    width = sum(widths)
    out = torch.empty((m, width + 3), dtype=grads.dtype, device=grads.device)
    col = 0
    for n, w in zip(PARAM_NAMES, widths):
        grad = leaves[n].grad
        if grad is None:
            out[:, col:col + w] = 0
        else:
            out[:, col:col + w] = grad.reshape(m, w)
        col += w
    if norm2d is None:
        norm2d = screen_grad_norm(grads[:, MEANS2D], view.sizes)
    stats = out[:, width:]
    stats.zero_()
    stats[:, 0].index_copy_(0, view.ids, norm2d)
    stats[:, 1].index_fill_(0, view.ids, 1.0)
    stats[:, 2].index_copy_(0, view.ids, view.radii.to(out.dtype) / torch.maximum(view.sizes[:, 0], view.sizes[:, 1]))
    return out
