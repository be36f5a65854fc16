"""The commit goes through the store, not the file system: a rank waiting for a commit makes no
file-system call, the store keeps the keys of O(1) checkpoints, a peer's failure arrives with
rank 0's decision (long before the timeout), and every rank's callback sees the same manifest."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.bench.commit_bench import OpCounter
from megatron_ext.engine import CheckpointEngine, CheckpointError
from megatron_ext.engine.save.commit import job_key

from helpers.procs import wait_until
from helpers.states import FAST, TINY

RUN = "0123456789ab"


def _pair(tmp_path, store=None, **config):
    store = store if store is not None else dist.HashStore()
    cfg = {"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST, **config}
    return [CheckpointEngine(cfg, rank=r, world_size=2, run_id=RUN, commit_store=store) for r in (0, 1)]


@pytest.mark.parametrize("early", [0, 1])
def test_a_rank_waiting_for_the_commit_makes_no_file_system_call(tmp_path, early):
    engines = _pair(tmp_path)
    late = 1 - early
    try:
        engines[early].save({"w": torch.ones(1000) * early}, "A", f"r{early}", version=1)
        job = engines[early].commit("A")
        key = job_key(job)
        wait_until(lambda: early not in engines[early].channel.missing(key), "the early rank posts its status")
        waiter = engines[early].committer._thread.ident
        with OpCounter() as ops:
            time.sleep(1.5)  # the early rank waits for the late one: the file-based protocol polled here
            calls = ops.take(waiter)
        assert calls == 0, f"rank {early} made {calls} file-system calls while waiting for the commit"
        engines[late].save({"w": torch.ones(1000) * late}, "A", f"r{late}", version=1)
        engines[late].commit("A")
        for engine in engines:
            engine.wait_persisted(timeout=30)
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)


def test_the_store_holds_the_keys_of_a_bounded_number_of_checkpoints(tmp_path):
    store = dist.HashStore()
    engines = _pair(tmp_path, store)
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
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)


def test_a_peer_failure_reaches_the_other_rank_with_the_decision(tmp_path, fault):
    engines = _pair(tmp_path)
    committed = threading.Event()  # rank 1's disk fills once both commits are asked for

    def fail_rank_one(level, path, offset, nbytes):
        if "/r1." in path:
            committed.wait(30)
            raise OSError(28, "No space left on device (injected)")

    fault(fail_rank_one)
    started = time.monotonic()
    try:
        for r, engine in enumerate(engines):
            engine.save({"w": torch.ones(5000) * r}, "A", f"r{r}", version=1)
            engine.commit("A")
        committed.set()
        with pytest.raises(CheckpointError, match="failed on rank 1: .*No space left"):
            engines[0].wait_persisted(timeout=60)
        assert time.monotonic() - started < FAST["persist_timeout_s"], "rank 0 waited out its timeout"
        assert not (tmp_path / "ckpt" / "A" / "manifest.json").exists()
    finally:
        for engine in engines:
            try:
                engine.shutdown(timeout=10)
            except CheckpointError:
                pass  # the injected failure, raised again at shutdown


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
