"""The owner's update of one step, on the rows the step touched.

The contributions of a step to this rank's blocks arrive as (owned row indices, rows of gradients and gsplat's
densification statistics), one per view, in the reference order (rank, then view). The update:
1. takes the rows some view touched (visible in it), as the owner's projections found them;
2. sums the contributions of those rows in the reference order into a compact [touched, D+3] buffer, one
   `index_add_` per contribution (the rows of one contribution are distinct, so each row's sum is the same
   sequence of additions on every rank count; rows a view did not touch go to a spare row that is dropped);
3. applies selective Adam to those rows only, parameter by parameter: gathered, updated and written back
   (`SelectiveAdam.step_rows`: no gradient or mask the size of the shard), or, on the CPU where the step touched
   more than 65% of the owned rows, in place over every owned row with the rows no view touched copied aside and
   written back (`SelectiveAdam.step_touched`: the same bits, gathering the fewer rows; the sum is then indexed by
   owned row, and a row no view touched has a zero gradient: its contributions are zero); of the SH
   coefficients, only those of the degree the step trains (`TrainedCoefficients`); for throughput-first's
   evidence, it notes each row's squared change;
4. adds the densification statistics (screen-space gradient norms, visibility counts, largest radii) of those rows.
A row no view touched is not read or written, moments included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from odin_ns.buffers import kept_rows
from odin_ns.runtime.sharded import PARAM_NAMES, param_columns
from odin_ns.scene.block_refine import STATE_KEYS


@dataclass
class UpdateResult:
    rows: torch.Tensor  # [T] owned rows the step touched, ascending (what the bounds check tests)
    delta_sq: Optional[torch.Tensor]  # [T] float64: squared change of the row's packed parameters (evidence): per
    # parameter summed over its columns in float32, the six sums added in float64


class OwnerUpdate:
    """The update of this rank's owned rows (see the module docstring)."""

    def __init__(self, model, num_rest: int, device: torch.device):
        self.model = model
        self.num_rest = num_rest
        self.device = device
        self.columns = list(param_columns(num_rest).values())
        self.width = self.columns[-1][1]
        self._acc: Optional[torch.Tensor] = None  # the sum's buffer (odin_ns.buffers): contiguous rows, where
        # `index_add_` takes its fast path (into a column slice it costs 5x: 1.05 against 0.2 ms for 10k rows)
        self._radii: Optional[torch.Tensor] = None  # the largest radius of each row
        self._place: Optional[torch.Tensor] = None  # each owned row's place among the touched rows
        self.coefficients = TrainedCoefficients(model, num_rest)
        # the CPU's ways: the masked in-place update where a step touches most rows, the largest radius gathered and
        # written back, a row's few columns summed as column additions; a GPU's: the gathered update, one
        # `index_reduce_`, torch's sum (the same bits: the tests run the GPU's ways on the CPU too)
        self.cpu_ways = device.type == "cpu"
        # on the CPU, the share of owned rows a step must touch for the in-place masked update (the same bits as
        # the gathered one; the whole update on one thread, 100k owned rows with 2 views' contributions, masked /
        # gathered: 60.9 / 40.4 ms at 45% touched, 52.3 / 52.5 at 65%, 44.9 / 63.7 at 80%)
        self.masked_share = 0.65

    def run(self, step: int, contributions: Sequence[Tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor,
            optimizers, track: bool, evidence: bool) -> UpdateResult:
        """`rows`: the owned rows some contribution's view saw (statistics' visible > 0), ascending (the splat path
        knows them from its projections, without a host read); every view of `step` rendered at that step's SH
        degree."""
        model, width = self.model, self.width
        n_owned = model.gauss_params["means"].shape[0]
        T = rows.shape[0]
        masked = self.cpu_ways and self.masked_share * n_owned < T < n_owned
        n = n_owned if masked else T  # the sum's rows: every owned row, or the touched ones in order
        self._acc = kept_rows(self._acc, n + 1, (width + 3,), torch.float32, self.device)
        self._radii = kept_rows(self._radii, n + 1, (), torch.float32, self.device)
        acc, radii = self._acc[:n + 1].zero_(), self._radii[:n + 1].zero_()
        place = None if n == n_owned else self._places(rows, n_owned)  # an owned row's place is its index
        for idx, piece in contributions:
            pos = idx if place is None else place.index_select(0, idx)
            acc.index_add_(0, pos, piece)
            if self.cpu_ways:  # the largest radius gathered, compared and written back (a
                # contribution's rows are distinct but for the spare row, which is dropped): `index_reduce_`'s amax
                # takes 6x as long on the CPU; on a GPU it is one kernel where this is three
                radii.index_copy_(0, pos, torch.maximum(radii.index_select(0, pos), piece[:, width + 2]))
            else:
                radii.index_reduce_(0, pos, piece[:, width + 2], "amax")
        untouched = self._untouched(rows, n_owned) if masked else None
        delta = None  # [n] float64: each of the sum's rows' squared change (evidence), selected at the end
        for name, (c0, c1) in zip(PARAM_NAMES, self.columns):
            param = model.gauss_params[name]
            grad = acc[:n, c0:c1].reshape((n,) + tuple(param.shape[1:]))
            optimizer = optimizers.optimizers[name]
            trained = self.coefficients.width(step, optimizer) if name == "features_rest" else None
            if masked:
                before, after = optimizer.step_touched(untouched, grad, keep_before=evidence, width=trained)
            else:
                before, after, _ = optimizer.step_rows(rows, grad, keep_before=evidence, width=trained)
            if T and evidence:  # a row's squared change over the parameter's columns in float32, the parameters'
                # sums added in float64 (the whole row in float64 cost more than the update itself); the squared
                # difference as one operation (aten's mse_loss without reduction: (a - b) * (a - b), the bits of
                # a sub and a square), written over `before`, the optimizer's kept copy (a new tensor the size of
                # the rows costs its page faults); the first sum taken as it is (0 + x is x: a sum of squares is
                # never -0.0), the masked update's rows selected once at the end (a row's additions are the same)
                change = row_sums(torch.ops.aten.mse_loss.out(after, before, 0, out=before).flatten(1),
                                  by_columns=self.cpu_ways)
                delta = change.double() if delta is None else delta.add_(change)
        delta_sq = None
        if evidence:
            delta_sq = torch.zeros(T, dtype=torch.float64, device=self.device) if delta is None else \
                delta.index_select(0, rows) if masked else delta
        if track:
            self._add_statistics(rows, acc[:n], radii[:n], n_owned)
        return UpdateResult(rows, delta_sq)

    def _places(self, rows: torch.Tensor, n_owned: int) -> torch.Tensor:
        """Each owned row's place among the touched rows (T, the spare row, for an untouched one): a table, one
        scatter, where a search per index costs its logarithm."""
        T = rows.shape[0]
        self._place = kept_rows(self._place, n_owned, (), torch.int64, self.device)
        place = self._place[:n_owned].fill_(T)
        place.index_copy_(0, rows, torch.arange(T, device=self.device))
        return place

    def _untouched(self, rows: torch.Tensor, n_owned: int) -> torch.Tensor:
        """The owned rows not in `rows` (ascending, distinct), ascending, without a host read: their number is
        known (`nonzero_static`, as the splat path takes the touched rows)."""
        untouched = torch.ones(n_owned, dtype=torch.bool, device=self.device).index_fill_(0, rows, False)
        return torch.nonzero_static(untouched, size=n_owned - rows.shape[0]).flatten()

    def _add_statistics(self, rows, acc, radii, n_owned) -> None:
        """gsplat's DefaultStrategy statistics of the touched rows: the sum of the views' screen-space gradient
        norms, the number of views that saw the row, its largest normalized radius."""
        state = self.model.strategy_state
        for k in STATE_KEYS:
            if state.get(k) is None or state[k].shape[0] != n_owned:
                state[k] = torch.zeros(n_owned, device=self.device)
        width = self.width
        if acc.shape[0] == n_owned:  # indexed by owned row (a row no view touched adds zeros)
            state["grad2d"] += acc[:, width]
            state["count"] += acc[:, width + 1]
            torch.maximum(state["radii"], radii, out=state["radii"])
            return
        state["grad2d"].index_add_(0, rows, acc[:, width])
        state["count"].index_add_(0, rows, acc[:, width + 1])
        state["radii"][rows] = torch.maximum(state["radii"][rows], radii)


def row_sums(x: torch.Tensor, by_columns: Optional[bool] = None) -> torch.Tensor:
    """[N, k] -> [N]: `x.sum(dim=1)`, bit for bit for the evidence's squares (float32 or float64, no -0.0: a row of
    -0.0 sums to +0.0 in torch's sum and to -0.0 here). On the CPU a row of 2-4 columns is summed as the columns
    added in order, which is how torch's CPU sum adds so few (tested, `tests/test_owner_update.py`), at a fifth of
    its cost (over [100k, 3], one thread: 0.09 against 0.42 ms: its loop over a row of 3 is the slow part).
    `by_columns`: whether to add the columns so (default: on the CPU)."""
    by_columns = x.device.type == "cpu" if by_columns is None else by_columns
    if not by_columns or x.dtype not in (torch.float32, torch.float64) or not 1 < x.shape[1] <= 4:
        return x.sum(dim=1)
    out = torch.add(x[:, 0], x[:, 1])
    for j in range(2, x.shape[1]):
        out.add_(x[:, j])
    return out


class TrainedCoefficients:
    """How many SH coefficients (of features_rest) an update must run Adam on: those of the degree the step trains
    ((degree + 1)^2 - 1), while the others have zero moments. A coefficient above that degree gets a zero gradient
    from every view (the SH evaluation does not read it); with zero moments Adam leaves it, and its moments, as they
    are, bit for bit, so the update skips it: 45 of a Gaussian's 59 columns until degree 1, for the first
    `sh_degree_interval` steps (the first tenth of splatfacto's schedule runs below degree 3). Zero moments hold
    from the start (densification gives new rows zero moments) but not for every state a checkpoint may bring, so
    they are checked once for each moments tensor the optimizer holds (a host read when densification, a rebuild
    or a resume replaces them), and every coefficient is updated where they are not zero."""

    def __init__(self, model, num_rest: int):
        self.model = model
        self.num_rest = num_rest
        self._checked: Optional[Tuple[torch.Tensor, torch.Tensor, bool]] = None  # moments, and whether clean

    def width(self, step: int, optimizer) -> Optional[int]:
        """The leading coefficients to update at `step` (None: all)."""
        degree = self.model.sh_degree_at(step)
        trained = self.num_rest if degree is None else min(self.num_rest, (degree + 1) ** 2 - 1)
        if trained >= self.num_rest:
            return None
        (param,) = optimizer.param_groups[0]["params"]
        state = optimizer.state.get(param, {})
        m, v = state.get("exp_avg"), state.get("exp_avg_sq")
        if m is None:  # no state yet: the optimizer starts it at zero
            return trained
        known = self._checked
        if known is None or known[0] is not m or known[1] is not v:
            rest = slice(trained, None)
            self._checked = known = (m, v, _all_positive_zero(m[:, rest]) and _all_positive_zero(v[:, rest]))
        return trained if known[2] else None


def _all_positive_zero(x: torch.Tensor) -> bool:
    """Whether every element of `x` is +0.0 (a -0.0 moment, which Adam does not make but a loaded state may hold,
    would come out of an update over every coefficient as +0.0: the coefficient is then not skipped)."""
    return bool(((x == 0) & ~torch.signbit(x)).all())
