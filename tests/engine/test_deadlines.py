"""One source per timeout (save/job/deadlines.py): when the training thread's wait and a background
stage's wait cover the same checkpoint, the stage's verdict, naming what is missing, is the error.

The races are made deterministic by delaying one rank's write (a fault hook), so that its
committer's clock starts well after the training thread's: before the rule, the training thread's
generic "did not finish in time" came first.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError
from megatron_ext.engine.save.commit import committer as commit_module
from megatron_ext.engine.save.job.deadlines import MARGIN_S, StageDeadline

from helpers.states import TINY

RUN = "0123456789ab"


def _ranks(tmp_path, n: int, timeout_s: float) -> list[CheckpointEngine]:
    store = dist.HashStore()
    cfg = {"save_dir": str(tmp_path / "ckpt"), **TINY, "persist_timeout_s": timeout_s, "snapshot_timeout_s": 30.0}
    return [CheckpointEngine(cfg, rank=r, world_size=n, run_id=RUN, commit_store=store) for r in range(n)]


def _close(engines: list[CheckpointEngine]) -> None:
    for engine in engines:
        try:
            engine.shutdown(timeout=10)
        except CheckpointError:
            pass  # the checkpoint under test failed: the engine stopped, as configured


def _delay_writes(fault, marker: str, seconds: float) -> None:
    """The first write of each tensor file whose path holds ``marker`` starts ``seconds`` late."""
    def hook(level, path, offset, nbytes):
        if marker in path and path.endswith(".safetensors") and offset == 0:
            time.sleep(seconds)
    fault(hook)


def _commit_all(engines, name: str, version: int) -> None:
    for r, engine in enumerate(engines):
        engine.save({"w": torch.full((1000,), float(r + version))}, name, f"r{r}", version=version)
        engine.commit(name)
    for engine in engines:
        engine.wait_persisted(timeout=30)


def test_a_stage_deadline_defers_a_waiter_and_releases_only_its_own_hold():
    stage = StageDeadline()
    now = time.monotonic()
    assert stage.ends(now) == now and stage.describe() == ""
    held = stage.hold(30.0, lambda: "rank 0's decision")
    assert stage.ends(now) >= now + 30.0 + MARGIN_S - 0.5 and stage.describe() == "rank 0's decision"
    assert stage.ends(now + 100) == now + 100  # a later own deadline stands
    assert stage.ends_on_tie(now) == now  # 30 s apart: no tie, the waiter's clock decides
    assert stage.ends_on_tie(now + 25.0) >= now + 30.0 + MARGIN_S - 0.5  # within the margin: the stage's
    second = stage.hold(1.0, lambda: "a free host-cache slot")
    stage.release(held)  # an older hold's release leaves the newer one
    assert stage.describe() == "a free host-cache slot"
    stage.release(second)
    assert stage.ends(now) == now and stage.describe() == ""
    stage.hold(1.0, lambda: 1 / 0)
    assert "unknown" in stage.describe()  # a broken description never raises


def test_rank_zero_durable_late_names_the_missing_rank_not_its_own_timeout(tmp_path, fault):
    # Rank 0's files of B become durable 1.5 s after its wait began, so its committer's clock
    # (3 s) ends 1.5 s after the training thread's: the decision must still be the error.
    engines = _ranks(tmp_path, 2, timeout_s=3.0)
    try:
        _commit_all(engines, "A", 1)
        _delay_writes(fault, "/r0.", 1.5)
        engines[0].save({"w": torch.ones(1000)}, "B", "r0", version=2)
        engines[0].commit("B")
        started = time.monotonic()
        with pytest.raises(CheckpointError) as raised:
            engines[0].wait_persisted("B")
        message = str(raised.value)
        assert "not every rank reported its files durable within 3s (missing ranks: 1)" in message, message
        assert "did not finish in time" not in message, message
        # It waited past its own 3 s for the committer's verdict (a lower bound the 1.5 s delay implies);
        # no upper bound: the message says whose verdict ended the wait, a clock on a shared machine cannot.
        assert time.monotonic() - started > 3.0 + 1.0
    finally:
        _close(engines)


def test_a_rank_waiting_for_a_late_rank_zero_gets_its_verdict(tmp_path, fault, monkeypatch):
    # Rank 1 waits for the decision timeout + grace (5 s); rank 0 posts 3 s late and collects for
    # 4 s more; rank 2 never saves B. Rank 1 must report rank 0's verdict (missing rank 2), not
    # "rank 0 did not decide".
    monkeypatch.setattr(commit_module, "DECISION_GRACE_S", 1.0)
    engines = _ranks(tmp_path, 3, timeout_s=4.0)
    try:
        _commit_all(engines, "A", 1)
        _delay_writes(fault, "/r0.", 3.0)
        for r in (0, 1):
            engines[r].save({"w": torch.ones(1000)}, "B", f"r{r}", version=2)
            engines[r].commit("B")
        with pytest.raises(CheckpointError) as raised:
            engines[1].wait_persisted("B")
        message = str(raised.value)
        assert "(missing ranks: 2)" in message and "did not decide" not in message, message
        with pytest.raises(CheckpointError, match=r"missing ranks: 2\)"):
            engines[0].wait_persisted("B")
    finally:
        _close(engines)


def test_a_rank_zero_that_never_posts_is_named_by_the_waiting_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_module, "DECISION_GRACE_S", 0.5)
    engines = _ranks(tmp_path, 2, timeout_s=1.0)
    try:
        _commit_all(engines, "A", 1)
        engines[1].save({"w": torch.ones(1000)}, "B", "r1", version=2)
        engines[1].commit("B")
        with pytest.raises(CheckpointError, match="rank 0 did not report or decide within 2s"):
            engines[1].wait_persisted("B")
    finally:
        _close(engines)


def test_a_near_tie_with_the_copy_s_own_wait_raises_the_copy_s_error(make_engine, fault):
    # Writes that never finish: the copy waits for a cache slot on its own 2 s clock, started at
    # the save; wait_snapshot's 1.8 s clock starts a moment later and would end first. Within the
    # margin the copy's verdict (the flush is stuck) is the one the caller gets.
    go = threading.Event()
    fault(lambda level, path, offset, nbytes: go.wait(60))
    engine = make_engine(host_cache_size=4 * 4096 / 2 ** 30, chunk_size_mb=0.004, persist_timeout_s=2.0)
    try:
        engine.save({"w": torch.ones(50_000)}, "A", version=1)
        with pytest.raises(CheckpointError, match="no host cache slot was freed within 2s"):
            engine.wait_snapshot(timeout=1.8)
    finally:
        go.set()
