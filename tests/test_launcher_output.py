"""The launcher's reading of the ranks' and torchrun's stderr, on the lines a real failed job prints."""

from __future__ import annotations

import io

from odin_ns.cli.launcher_output import StderrFilter

TORCHRUN_REPORT = """W1203 12:51:34.959000 22531 .venv/lib/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 22536 closing signal SIGTERM
odin: rank 0: stopped by the launcher (another rank failed or the job was interrupted); see the launcher's message
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File ".venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
  rank      : 1 (local_rank: 1)
"""
THREAD_TRACEBACK = """Traceback (most recent call last):
  File "viewer.py", line 3, in run
ValueError: a thread of rank 0 failed
"""


def run(lines: str) -> tuple:
    out = io.StringIO()
    f = StderrFilter(out)
    for line in io.StringIO(lines):
        f.feed(line)
    f.finish()
    return f, out.getvalue()


def test_a_user_error_from_every_rank_is_one_line_and_torchruns_report_is_dropped():
    f, text = run("odin: error: data folder /x does not exist\n" * 2 + "progress line\n" + TORCHRUN_REPORT)
    assert f.quiet_end and text == "odin: error: data folder /x does not exist\nprogress line\n"


def test_a_clean_stop_keeps_a_threads_traceback_but_not_torchruns_report():
    f, text = run(THREAD_TRACEBACK + "odin: stopped after step 9 (Ctrl+C): checkpoint c.ckpt\n" + TORCHRUN_REPORT)
    assert f.stopped and "a thread of rank 0 failed" in text and "ChildFailedError" not in text
    assert "closing signal" not in text


def test_a_crash_keeps_everything():
    f, text = run(THREAD_TRACEBACK + TORCHRUN_REPORT)
    assert not f.quiet_end
    assert "a thread of rank 0 failed" in text and "ChildFailedError" in text and "rank      : 1" in text
    assert "closing signal SIGTERM" in text


def test_ranks_that_lost_their_peers_elsewhere_are_summed_up_by_the_launcher():
    """Another node went away: every rank here says so in one line; the launcher holds those lines back and says
    what happened once (train.peers_lost), dropping torchrun's report. A rank killed here is the failure instead."""
    from odin_ns.cli.train import failed_ranks, peers_lost

    lost = "odin: rank {}: lost the connection to the other ranks (Connection closed by peer [127.0.0.1]:4)\n"
    f, _ = run(lost.format(2) + lost.format(3) + TORCHRUN_REPORT.replace("rank      : 1", "rank      : 2"))
    assert f.lost_ranks == {2, 3} and "lost the connection" not in _
    assert failed_ranks(TORCHRUN_REPORT) == [1]
    assert peers_lost(f, 2, "rank      : 2 (local_rank: 0)\n") and not peers_lost(f, 2, TORCHRUN_REPORT)
    assert peers_lost(f, 2, "no summary: torchrun lost the rendezvous store") and not peers_lost(f, 3, "")
    f.peers_lost = True
    out = io.StringIO()
    quiet = StderrFilter(out)
    for line in io.StringIO(lost.format(0) + TORCHRUN_REPORT):
        quiet.feed(line)
    quiet.peers_lost = True
    quiet.finish()
    assert "ChildFailedError" not in out.getvalue() and "Traceback" not in out.getvalue()


KILLED_RANK_1 = """odin: rank 0: stopped by the launcher (another rank failed or the job was interrupted); see the launcher's message
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 143 (pid: 10606)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 10607)  (SIGKILL)
"""


def test_the_launcher_names_the_killed_rank_not_the_one_torchrun_stopped_after_it():
    """Rank 1 killed: torchrun stops rank 0, which says so, and may list it first among the failures (a loaded
    machine's order, seen in a full run); the launcher names rank 1."""
    from odin_ns.cli.train import culprit

    f, _ = run(KILLED_RANK_1)
    assert f.torn_down_ranks == {0}
    assert culprit(f, KILLED_RANK_1) == "1"
