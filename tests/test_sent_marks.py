"""The inline lane's notes of sent gradients (runtime/sent_marks.py), between real processes sharing a store: ranks
on one host read each other's notes from memory (no round trip; the file is gone once mapped), a rank on another
host through the store, and a probe never answers "sent" before the note."""

import multiprocessing as mp
import os
import time

import torch.distributed as dist

from odin_ns.runtime.sent_marks import SentMarks

PREFIX = "test/sent/"


def _rank(store_path: str, rank: int, hosts, out):
    store = dist.FileStore(store_path, len(hosts))
    marks = SentMarks(store, rank, len(hosts), PREFIX, host=hosts[rank])
    others = [q for q in range(len(hosts)) if q != rank]
    before = marks.all_sent(others, 0)  # nobody has noted anything yet
    marks.note(0)
    store.set(f"noted/{rank}", "1")
    store.wait([f"noted/{q}" for q in others])  # every rank's note is out
    deadline = time.monotonic() + 60
    while not marks.all_sent(others, 0):  # a note in memory or the store may land late, not never
        assert time.monotonic() < deadline, "a note never arrived"
        time.sleep(0.001)
    out.put((rank, before, marks.local_peers, marks.all_sent(others, 1), marks._path is None or
             not os.path.exists(marks._path), marks._to_store))


def _run(tmp_path, hosts):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(tmp_path / "store"), r, hosts, out)) for r in range(len(hosts))]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_notes_between_ranks_on_one_host_and_across_hosts(tmp_path):
    # ranks 0 and 1 on one host (memory), rank 2 on another (the store)
    results = _run(tmp_path, ["a", "a", "b"])
    for rank, before, local, later, removed, to_store in results:
        assert before is False, rank  # no note before it was made
        assert later is False, rank  # step 1 was never noted
        assert local == {0: [1], 1: [0], 2: []}[rank], (rank, local)
        assert removed, rank  # the file is removed once its readers mapped it
        assert to_store, rank  # rank 2 reads 0's and 1's notes from the store; nobody reads 2's from memory


def test_ranks_on_one_host_leave_the_store_out(tmp_path):
    for rank, before, local, later, removed, to_store in _run(tmp_path, ["a", "a"]):
        assert (before, later, local, removed, to_store) == (False, False, [1 - rank], True, False), rank
