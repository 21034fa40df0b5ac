"""The actions of a rank's program: kinds, a readable repr and its parser (the style of PyTorch's pipelining
schedules, `torch/distributed/pipelining/schedules.py`: `_Action` with a repr and `_Action.from_str`).

One action is one small piece of a rank's work in one step:
- `W b3@v7 <-r1` wait until block 3 (owned by rank 1) is at version 7: take rank 1's publications of the blocks
  the step reads (several blocks of one owner are one action: `W b3@v7 W b5@v7 <-r1`); `~1` when the read may be
  one version behind (throughput-first);
- `R v12` render view 12 and back-propagate;
- `G s0 b3,b5->r1` send the gradients of the step's view in slot 0 (the rank's first view of the step) on rank 1's
  blocks to rank 1, once that view is rendered (a view's gradients leave while the next view renders);
- `U b0,b2` the owner's update of its blocks once every contribution of the step is in; `U~` on the owner's
  update thread, beside the render (throughput-first);
- `P b0,b2->r1` publish the update to a rank that reads those blocks next;
- `B` the global barrier (odin-barrier).
A rank's list for a phase is the program its runtime runs (`runtime.interpreter`) and the simulator replays
(`schedule.simulate`); `schedule.policies` generates it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Tuple

KINDS = ("W", "R", "G", "U", "P", "B")


@dataclass(frozen=True)
class Action:
    """One small step of a rank's work; `blocks` are block ids, `peer` the other rank (-1 for none)."""

    kind: str  # "W" validate, "R" render, "G" gradients to an owner, "U" owner update, "P" publish, "B" barrier
    step: int
    peer: int = -1
    blocks: Tuple[int, ...] = ()
    version: Tuple[int, ...] = ()  # "W": the version each block must be at
    view: int = -1  # "R"
    stale: int = 0  # "W": how many versions behind the newest the read may be (throughput-first)
    on_thread: bool = False  # on the owner's update thread, beside the render (throughput-first)
    slot: int = -1  # "G": which of the rank's views of the step (0 = its first) the gradients are of

    def __repr__(self) -> str:
        lane = "~" if self.on_thread else ""  # on the communication lane, beside the renders
        if self.kind == "R":
            return f"R v{self.view}"
        if self.kind == "B":
            return "B"
        if self.kind == "W":
            text = " ".join(f"W{lane} b{b}@v{v}" for b, v in zip(self.blocks, self.version)) + f" <-r{self.peer}"
            return text + (f" ~{self.stale}" if self.stale else "")
        if self.kind == "U":
            return f"U{lane} " + ",".join(f"b{b}" for b in self.blocks)
        slot = f"s{self.slot} " if self.kind == "G" else ""
        return f"{self.kind}{lane} {slot}" + ",".join(f"b{b}" for b in self.blocks) + f"->r{self.peer}"


def parse_action(text: str, step: int) -> Action:
    """Inverse of `Action.__repr__` for one action of one step (hand-written lists in a schedule JSON)."""
    text = text.strip()
    if text == "B":
        return Action("B", step)
    kind, _, rest = text.partition(" ")
    lane = kind.endswith("~")
    kind = kind.rstrip("~")
    if kind == "R":
        return Action("R", step, view=int(rest.lstrip("v")))
    if kind == "W":
        text, _, stale = text.partition(" ~")
        body, _, peer = text.rpartition("<-r")
        pairs = [w.strip().split("@v") for w in re.split(r"W~? ", body.strip())[1:]] if body.strip() else []
        return Action("W", step, int(peer), tuple(int(b.lstrip("b")) for b, _ in pairs),
                      tuple(int(v) for _, v in pairs), stale=int(stale or 0), on_thread=lane)
    if kind == "U":
        return Action("U", step, blocks=tuple(int(b.lstrip("b")) for b in rest.split(",") if b), on_thread=lane)
    if kind in ("G", "P"):
        slot = -1
        if kind == "G":
            head, _, rest = rest.partition(" ")
            if not head.startswith("s"):
                raise ValueError(f"a G action names its view's slot (G s0 b3->r1): {text!r}")
            slot = int(head[1:])
        blocks, _, peer = rest.rpartition("->r")
        return Action(kind, step, int(peer), tuple(int(b.lstrip("b")) for b in blocks.split(",") if b),
                      on_thread=lane, slot=slot)
    raise ValueError(f"unknown action {text!r}")
