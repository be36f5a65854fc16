"""The commit goes through the store, not the file system: a rank waiting for a commit makes no
file-system call, the store keeps the keys of O(1) checkpoints, a peer's failure arrives with
rank 0's decision (long before the timeout), flat or through a group's leader (even one whose
committer died), and every rank's callback sees the same manifest."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from megatron_ext.bench.commit_bench import OpCounter
from megatron_ext.engine import CheckpointEngine, CheckpointError, read_manifest
from megatron_ext.engine.save.commit.committer import job_key
from megatron_ext.engine.save.commit.coordination import CommitChannel

from helpers.states import FAST, TINY

RUN = "0123456789ab"
_open = open  # the unwrapped open: reading the worker's counters must not count as the committer's call


def _pair(tmp_path, store=None, world=2, **config):
    store = store if store is not None else dist.HashStore()
    cfg = {"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST, **config}
    return [CheckpointEngine(cfg, rank=r, world_size=world, run_id=RUN, commit_store=store) for r in range(world)]


def _shutdown(engines) -> None:
    for engine in engines:
        try:
            engine.shutdown(timeout=10)
        except CheckpointError:
            pass  # an injected failure, raised again at shutdown


def _worker_syscalls(pid: int) -> int:
    """Read and write system calls the I/O worker process has made so far (the kernel's count, all threads)."""
    with _open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["syscr"]) + int(fields["syscw"])


class _WaitSpy:
    """The committer's real store and I/O channel, with the two moments that bound its wait recorded on
    its own thread: its status posted (the ``count`` increment) and its blocking ``wait`` returning.
    ``entered`` is set when that wait begins, so the late rank is started only once the early one is
    really waiting."""

    def __init__(self, store, io, ops: OpCounter, worker_pid):
        self.store, self.io, self.ops, self.worker_pid = store, io, ops, worker_pid
        self.entered = threading.Event()
        self.marks: dict[str, tuple[int, int]] = {}

    def _mark(self, name: str) -> None:
        ident = threading.get_ident()
        self.marks[name] = (self.ops.counts.get(ident, 0), _worker_syscalls(self.worker_pid()))

    def atomic_write(self, path, data):
        """The committer's report, written by the worker: its syscalls must show in the same count."""
        before = _worker_syscalls(self.worker_pid())
        self.io.atomic_write(path, data)
        self.marks["report"] = (before, _worker_syscalls(self.worker_pid()))

    def add(self, key, amount):
        value = self.store.add(key, amount)
        if key.endswith("/count"):
            self._mark("posted")
        return value

    def wait(self, keys, timeout):
        self.entered.set()
        try:
            return self.store.wait(keys, timeout)
        finally:
            self._mark("woke")

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.mark.parametrize("early", [0, 1])
def test_a_rank_waiting_for_the_commit_makes_no_file_system_call(tmp_path, early):
    """Counted from the status post to the end of the wait, on the committer thread (``os`` calls) and in
    the I/O worker process, where the engine does its file I/O by default (the kernel's syscall count).
    The same counters must see the work before the post (the oracle that they are not blind)."""
    engines = _pair(tmp_path)
    late = 1 - early
    try:
        assert engines[early].config.flush_process  # the default: file I/O in a worker process
        with OpCounter() as ops:
            spy = _WaitSpy(engines[early].channel.waiting, engines[early].committer.io, ops,
                           lambda: engines[early].pipeline.io.pid)
            engines[early].channel.waiting = engines[early].committer.io = spy
            engines[early].save({"w": torch.ones(1000) * early}, "A", f"r{early}", version=1)
            engines[early].commit("A")
            assert spy.entered.wait(30), f"rank {early}'s committer never blocked in the store's wait"
            worker_before = _worker_syscalls(engines[early].pipeline.io.pid)
            engines[late].save({"w": torch.ones(1000) * late}, "A", f"r{late}", version=1)
            engines[late].commit("A")
            for engine in engines:
                engine.wait_persisted(timeout=30)
        calls_posted, worker_posted = spy.marks["posted"]
        calls_woke, worker_woke = spy.marks["woke"]
        assert calls_woke - calls_posted == 0, f"rank {early}'s committer made file-system calls while waiting"
        assert worker_woke - worker_posted == 0, f"rank {early}'s I/O worker worked while the rank waited"
        assert worker_before == worker_posted  # nothing at all between the post and the late rank's save
        report_before, report_after = spy.marks["report"]
        assert report_after > report_before  # the oracle: the count sees the worker write the rank report
        assert (tmp_path / "ckpt" / "A" / "manifest.json").exists()
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)


@pytest.mark.parametrize("world", [2, 5], ids=["flat", "groups"])
def test_the_store_holds_the_keys_of_a_bounded_number_of_checkpoints(tmp_path, world):
    """With five ranks in groups of two (0-1, 2-3, 4) the groups' keys are deleted too."""
    store = dist.HashStore()
    engines = _pair(tmp_path, store, world=world, commit_fan_in=2)
    try:
        for i in range(1, 9):
            for r, engine in enumerate(engines):
                engine.save({"w": torch.full((100,), float(i + r))}, f"iter_{i:07d}", f"r{r}", version=i)
                engine.commit(f"iter_{i:07d}")
            for engine in engines:
                engine.wait_persisted(timeout=30)
            if i == 2:
                after_two = store.num_keys()
        assert store.num_keys() <= after_two, "keys of settled checkpoints are never deleted"
        assert sorted(read_manifest(str(tmp_path / "ckpt" / "iter_0000008"))["files"]) == [f"r{r}" for r in range(world)]
        assert torch.equal(engines[-1].load("iter_0000008", f"r{world - 1}")["w"], torch.full((100,), float(7 + world)))
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)


@pytest.mark.parametrize("world, failing", [(2, 1), (4, 2), (4, 3)],
                         ids=["flat", "a leader of another group", "a member of another group"])
def test_a_peer_failure_reaches_the_other_rank_with_the_decision(tmp_path, fault, world, failing):
    """Rank 0's persist timeout is far beyond the test's own wait: only the failing rank's status can end
    its wait in time, and the error says it is that failure (no clock is read). With four ranks in
    groups of two (0-1, 2-3) the status reaches rank 0 through the failing rank's group's leader."""
    engines = _pair(tmp_path, world=world, persist_timeout_s=3600.0, commit_fan_in=2)
    committed = threading.Event()  # the failing rank's disk fills once every commit is asked for

    def fail_one_rank(level, path, offset, nbytes):
        if f"/r{failing}." in path:
            committed.wait(30)
            raise OSError(28, "No space left on device (injected)")

    fault(fail_one_rank)
    try:
        for r, engine in enumerate(engines):
            engine.save({"w": torch.ones(5000) * r}, "A", f"r{r}", version=1)
            engine.commit("A")
        committed.set()
        with pytest.raises(CheckpointError, match=f"failed on rank {failing}: .*No space left") as raised:
            engines[0].wait_persisted(timeout=120)
        assert "not every rank reported" not in str(raised.value)  # the peer's status, not a timeout verdict
        assert "did not forward" not in str(raised.value)
        assert not (tmp_path / "ckpt" / "A" / "manifest.json").exists()
    finally:
        _shutdown(engines)


def test_a_leader_whose_committer_dies_still_fails_the_checkpoint_at_once(tmp_path, monkeypatch):
    """Rank 2 leads ranks 2-3; its committer thread dies while posting (the store refuses its record),
    so it neither posts nor forwards. Its failure handler forwards its failure for the group at once:
    rank 0 decides on it, not on its timeout (which would name the group's leader)."""
    engines = _pair(tmp_path, world=4, persist_timeout_s=60.0, commit_fan_in=2)
    real = CommitChannel.post_durable

    def post_durable(self, key, head, shares):
        if self.rank == 2:
            raise CheckpointError("the commit store refused the record (injected)")
        return real(self, key, head, shares)

    monkeypatch.setattr(CommitChannel, "post_durable", post_durable)
    try:
        for r, engine in enumerate(engines):
            engine.save({"w": torch.ones(500) * r}, "A", f"r{r}", version=1)
            engine.commit("A")
        for r in (0, 1, 3):
            with pytest.raises(CheckpointError, match="failed on rank 2: .*refused the record"):
                engines[r].wait_persisted(timeout=20)
        assert not (tmp_path / "ckpt" / "A" / "manifest.json").exists()
    finally:
        _shutdown(engines)


def test_every_rank_sees_the_committed_manifest(tmp_path):
    engines = _pair(tmp_path)
    seen: dict[int, dict] = {}
    try:
        for r, engine in enumerate(engines):
            engine.save({"w": torch.ones(100) * r}, "A", f"r{r}", version=7)
            engine.commit("A", on_committed=lambda m, r=r: seen.setdefault(r, {"version": m["version"],
                                                                                "files": sorted(m["files"])}))
        for engine in engines:
            engine.wait_persisted(timeout=30)
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)
    assert seen[0] == seen[1] == {"version": 7, "files": ["r0", "r1"]}
