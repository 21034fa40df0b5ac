"""A rank's receives, posted in each pair's order as soon as their sizes are known.

On gloo a message moves when both sides have posted it, and a receive posted while the transport's thread is busy
with the pair waits for it: a receive posted only when its step needs it costs the reader that wait (measured on
2 CPU ranks of the city: `irecv` about 2 ms a call on a rank whose lane posted every receive on demand, 0.1-0.5 ms
where the exact policies posted theirs ahead). Every message a pair carries into this rank is in its sender's list,
in the order the sender runs it (the interpreter, or throughput-first's one lane, posts all of a rank's messages
in list order): for each of the sender's actions toward this rank, a G (one view's splat gradients of a step) or
a P (a publication: its header, then its splats). So the order of a pair's receives is data: this class walks it
and posts each receive once the ones before it on the pair are posted and its size is known: a header's from the
plan, a G's once this rank has made every projection of its step, a publication's splats only by the reader that
read its header (`passed`). A receive the handlers post themselves (`passed`) must be the pair's next: out of
order, the run stops with an error instead of pairing a message with the wrong buffer.

Gloo only (`Channels.posts_ahead`): NCCL runs a rank's point-to-point batches in order on one stream, where a
receive posted early holds up the rank's own later sends.
Written here: torch.distributed has no notion of a list's order.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from odin_ns.runtime.rank_runtime import OdinRuntimeError

# ("P", update, -1): a header; ("p", update, -1): its splats; ("G", step, slot): a reader's view's gradients
Item = Tuple[str, int, int]


class Inbox:
    """The receives of one phase into rank `me`. `sizes(peer, item)` gives an item's receive buffer (None while
    its size is not known; an empty one for a message that is not sent); posted receives go into `early`, keyed
    (kind, step, peer, slot) as the handlers look them up ("P" for a header, "G" for a view's gradients)."""

    def __init__(self, plan, me: int, channels, sizes: Callable[[int, Item], Optional[torch.Tensor]],
                 early: Dict[Tuple[str, int, int, int], tuple]):
        self.channels, self.sizes, self.early = channels, sizes, early
        self.order: Dict[int, List[Item]] = {}
        for peer in range(plan.num_ranks):
            if peer == me:
                continue
            items: List[Item] = []
            for a in plan.actions(peer):
                if a.peer != me:
                    continue
                if a.kind == "G":
                    items.append(("G", a.step, a.slot))
                elif a.kind == "P":
                    items += [("P", a.step, -1), ("p", a.step, -1)]
            self.order[peer] = items
        self.at = dict.fromkeys(self.order, 0)  # per pair, its first receive not posted

    def pump(self, peers=None) -> None:
        """Post every receive whose turn has come and whose size is known, on the pairs of `peers` (all)."""
        recvs: List[Tuple[Tuple[str, int, int, int], int, torch.Tensor]] = []
        for peer in self.order if peers is None else peers:
            items, i = self.order[peer], self.at[peer]
            while i < len(items) and items[i][0] != "p":
                buf = self.sizes(peer, items[i])
                if buf is None:
                    break
                kind, step, slot = items[i]
                recvs.append(((kind, step, peer, slot), peer, buf))
                i += 1
            self.at[peer] = i
        if not recvs:
            return
        works = iter(self.channels.batch([], [(peer, t) for _, peer, t in recvs], "validate", wait=False, ahead=True))
        for key, _, t in recvs:  # a receive of nothing is not posted
            self.early[key] = (t, next(works) if t.numel() else None)

    def passed(self, peer: int, item: Item) -> None:
        """A handler posted the receive of `item` on `peer`'s pair itself (a publication's splats, or a receive
        whose turn came before its size was known): the pair moves on, and what follows is posted."""
        items, i = self.order[peer], self.at[peer]
        if i >= len(items) or items[i] != item:
            raise OdinRuntimeError(f"rank {peer}'s messages: {item} received where its list sends "
                                   f"{items[i] if i < len(items) else 'nothing more'} next")
        self.at[peer] = i + 1
        self.pump([peer])
