"""An evaluation on several ranks, rendered from the owners' splats: no whole model on rank 0.

nerfstudio evaluates on rank 0 (an image, a batch, or every held-out image: `Trainer.eval_iteration`) through the
model's `get_outputs`. On several ranks rank 0 holds only its own blocks; instead of gathering the whole model to it
(every Gaussian's 59 numbers to one rank, and one rank holding them all: what sharding is for is a model no rank
holds), each render of an evaluation is a request every rank serves, as a training view's is (DESIGN.md "The data
path: splats, not rows"): rank 0 broadcasts the camera, every rank projects its owned Gaussians for it and sends
rank 0 the visible splats with their places in the whole model, and rank 0 rasterizes them in the order of those
places, the order one process renders the whole model in: the same image, bit for bit on the CPU. The other ranks
serve requests until rank 0 says the evaluation is over (from a `finally`). A request's collectives complete even
where rank 0's own projection fails (it sends none and raises after), so that the stop meets the others in their
broadcast; a serving rank that fails leaves rank 0 in the request until the launcher ends the job (the channels'
timeout at most). An evaluation runs after a step that ends its phase (`PhaseRules.of_trainer`): nothing is in
flight and every update is applied. Time a serving rank spends waiting for rank 0 (its rasterization and metrics)
counts as `gather`; the renders themselves, on every rank, as nerfstudio's loop (`loop_s`), as one process's
evaluation does.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import SPLAT_WIDTH
from odin_ns.runtime.block_table import expand_ranges
from odin_ns.runtime.sharded import PARAM_NAMES
from odin_ns.runtime.transport import comm_device, exchange
from odin_ns.runtime.view_projection import project_rows

STOP, RENDER = 0.0, 1.0
COMMAND = 1 + 16 + 9 + 3  # what to do, the camera's viewmat and K, width, height, SH degree (-1: colours, no SH)
WIRE = SPLAT_WIDTH + 1 + 2  # as int32 words: a splat's numbers, its radius, its place in the whole model (int64)


class EvalSplats:
    """One evaluation's renders (collective: rank 0 `request`s and `stop`s, every other rank `serve`s)."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model
        self.antialiased = self.model.config.rasterize_mode == "antialiased"
        self.renders = 0
        table, rank = engine.table, engine.env.rank
        owned = table.owned(rank)
        # this rank's rows in the whole model: its blocks' places, in the order it holds them
        self.places = expand_ranges(table.first_places()[owned], table.count[owned],
                                    table.num_owned_gaussians(rank)).to(engine.device)

    def request(self, viewmat: torch.Tensor, K: torch.Tensor, width: int, height: int, sh_degree: Optional[int]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: every owner's visible splats [n, SPLAT_WIDTH] and radii [n] for this camera, in the order one
        process renders them."""
        command = torch.cat([torch.tensor([RENDER], dtype=torch.float64), viewmat.detach().reshape(16).double().cpu(),
                             K.detach().reshape(9).double().cpu(),
                             torch.tensor([width, height, -1 if sh_degree is None else sh_degree],
                                          dtype=torch.float64)])
        dist.broadcast(command.to(comm_device()), 0)
        self.renders += 1
        return self._answer(viewmat.reshape(4, 4), K.reshape(3, 3), width, height, sh_degree)

    def stop(self) -> None:
        """Rank 0: the evaluation is over."""
        command = torch.zeros(COMMAND, dtype=torch.float64, device=comm_device())
        command[0] = STOP
        dist.broadcast(command, 0)

    def serve(self) -> None:
        """Every rank but 0: answer rank 0's requests until it stops."""
        log = self.engine.log
        while True:
            command = torch.empty(COMMAND, dtype=torch.float64, device=comm_device())
            with log.waiting("gather"):
                dist.broadcast(command, 0)
            command = command.cpu()
            if command[0].item() == STOP:
                return
            width, height, sh = (int(v) for v in command[26:29].tolist())
            self._answer(command[1:17].reshape(4, 4).float(), command[17:26].reshape(3, 3).float(), width, height,
                         None if sh < 0 else sh)

    def _answer(self, viewmat: torch.Tensor, K: torch.Tensor, width: int, height: int, sh_degree: Optional[int]
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """This rank's splats to rank 0; on rank 0, everyone's in render order."""
        engine, rank = self.engine, self.engine.env.rank
        failed: Optional[BaseException] = None
        try:
            mine = self._own(viewmat, K, width, height, sh_degree)
        except Exception as e:  # rank 0: the request's collectives still complete (see the module docstring)
            if rank != 0:
                raise
            failed, mine = e, torch.zeros((0, WIRE), dtype=torch.int32, device=engine.device)
        counts = self._counts(mine.shape[0])
        shapes = {p: (n, WIRE) for p, n in enumerate(counts) if p != rank} if rank == 0 else {}
        received = exchange({0: mine} if rank != 0 else {}, shapes, torch.int32, engine.device, engine.log, "gather")
        if failed is not None:
            raise failed
        if rank != 0:
            return None
        wire = torch.cat([mine] + [received[p] for p in sorted(received)])
        # the places' int64 words copied out whole (a view of one or no row keeps the slice's odd offset)
        places = wire[:, SPLAT_WIDTH + 1:].clone(memory_format=torch.contiguous_format).view(torch.int64).reshape(-1)
        wire = wire.index_select(0, torch.argsort(places))
        return wire[:, :SPLAT_WIDTH].contiguous().view(torch.float32), wire[:, SPLAT_WIDTH].contiguous()

    def _own(self, viewmat: torch.Tensor, K: torch.Tensor, width: int, height: int, sh_degree: Optional[int]
             ) -> torch.Tensor:
        """This rank's visible splats for the camera, as wire rows: the splat's numbers, its radius, its place."""
        engine, device = self.engine, self.engine.device
        cams = RowCameras.one(viewmat.to(device), K.to(device), width, height)
        with torch.no_grad():
            rows = {n: self.model.gauss_params[n].detach() for n in PARAM_NAMES}
            view = project_rows(rows, engine.num_rest, cams, sh_degree, self.antialiased, keep_graph=False)
        places = self.places.index_select(0, view.ids)
        return torch.cat([view.splats.contiguous().view(torch.int32), view.radii.to(torch.int32)[:, None],
                          places.contiguous().view(torch.int32).reshape(-1, 2)], dim=1)

    def _counts(self, n: int) -> List[int]:
        """Every rank's splat count for this render (one host read)."""
        mine = torch.tensor([n], dtype=torch.int64, device=comm_device())
        every = [torch.empty_like(mine) for _ in range(self.engine.env.world_size)]
        with self.engine.log.waiting("gather"):
            dist.all_gather(every, mine)
        return torch.cat(every).tolist()
