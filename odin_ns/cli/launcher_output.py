"""What of the ranks' and torchrun's stderr reaches the person who ran `odin-train`.

Every rank checks the same input, so a user's mistake reaches stderr once per rank, and torchrun then adds its own
report of the "failure" (a traceback of its own and a ChildFailedError summary, hundreds of lines). A user's mistake
is one `odin: error:` line, so the launcher prints each distinct such line once and, when the job ended in one (or
in a clean Ctrl+C stop), drops torchrun's report and the ranks' "stopped by the launcher" notices. A real crash
keeps everything: the failing rank's traceback and torchrun's summary, which names the rank.
Written by hand: torchrun has no option to keep its failure report to itself.
"""

from __future__ import annotations

import re
from typing import List, TextIO

USER_ERROR = "odin: error:"
STOPPED = "odin: stopped"
LOST = re.compile(r"^odin: rank (\d+): lost the connection to the other ranks")
# torchrun's own log lines (its logger's prefix names the module) and the ranks' notices when it tears them down
TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ .*torch/distributed/")
TORN_DOWN = re.compile(r"^odin: rank (\d+): stopped by the launcher")
TRACEBACK = "Traceback (most recent call last)"
TORCHRUN_REPORT = "ChildFailedError"


class StderrFilter:
    """Feed it the merged stderr line by line; `finish` says what the job's end means for what was held back."""

    def __init__(self, out: TextIO):
        self.out = out
        self.errors: List[str] = []
        self.stopped = False
        self.held: List[str] = []
        self.logs: List[str] = []  # torchrun's log lines and the ranks' notices when it tears them down
        self.holding = False  # from the first traceback on, lines wait for the end (they may be torchrun's report)
        self.lost: List[str] = []  # ranks' notices that their peers are gone (summed up by the launcher)
        self.lost_ranks: set = set()
        self.torn_down_ranks: set = set()  # ranks torchrun stopped because another failed (never the failure)

    def feed(self, line: str) -> None:
        if line.startswith(USER_ERROR):
            if line not in self.errors:
                self.errors.append(line)
                self._write(line)
            return
        lost = LOST.match(line)
        if lost:
            self.lost_ranks.add(int(lost.group(1)))
            self.lost.append(line)
            return
        if line.startswith(STOPPED):
            self.stopped = True
            self._write(line)
            return
        torn_down = TORN_DOWN.match(line)
        if torn_down:
            self.torn_down_ranks.add(int(torn_down.group(1)))
        if torn_down or TORCHRUN_LOG.search(line):
            self.logs.append(line)
            return
        if line.startswith(TRACEBACK):
            self.holding = True
        if self.holding:
            self.held.append(line)
            return
        self._write(line)

    @property
    def quiet_end(self) -> bool:
        """The job ended the way a user expects (their mistake, said in one line, or a clean stop), or its ranks here
        lost their peers (what failed is elsewhere: its own launcher reports it)."""
        return bool(self.errors) or self.stopped or self.peers_lost

    peers_lost = False  # set by the launcher when every rank here ended with a lost-connection notice

    def finish(self) -> None:
        """Everything held back is written, unless the job ended quietly: then torchrun's report and log lines are
        dropped, and any other traceback (a thread of a rank that failed along the way) is still written."""
        blocks: List[List[str]] = []
        for line in self.held:
            if line.startswith(TRACEBACK) or not blocks:
                blocks.append([])
            blocks[-1].append(line)
        if not self.quiet_end:
            blocks.append(self.logs)
        for block in blocks:
            if self.peers_lost:
                continue  # torchrun's report, or its own traceback when the lost node held the rendezvous store
            if not self.quiet_end or not any(TORCHRUN_REPORT in line for line in block):
                for line in block:
                    self._write(line)
        self.held, self.logs = [], []

    def _write(self, line: str) -> None:
        self.out.write(line)
        self.out.flush()
