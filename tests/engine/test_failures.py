"""Crashes and background failures: a writer killed mid-flush loses nothing committed; a failing
write (no space left) reaches the caller as a CheckpointError naming it, within the timeout, and
the failed checkpoint is never committed."""

from __future__ import annotations

import errno
import threading
import time
import json
from pathlib import Path

import pytest

from megatron_ext.engine import CheckpointEngine, CheckpointError, read_manifest

from helpers.procs import run_worker
from helpers.states import FAST, TINY, assert_same, committed_names, seeded_state

LIFECYCLE = Path(__file__).resolve().parent / "_lifecycle_worker.py"


def _state(i: int, n: int = 20_000) -> dict:
    return seeded_state(i, n, (30, 40))


def _enospc_for(checkpoint: str, after: threading.Event | None = None):
    """A write hook: ENOSPC for ``checkpoint``'s files (once ``after`` is set, when given)."""
    def hook(level, path, offset, nbytes):
        if f"/{checkpoint}/" in path:
            if after is not None:
                after.wait(30)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return hook


def test_sigkill_in_the_middle_of_a_flush_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    run_worker(LIFECYCLE, "killed-mid-flush", str(root), check_rc=-9)
    assert committed_names(root) == ["A"]
    partial = [p for p in (root / "B").iterdir() if p.name.endswith(".safetensors")]
    # Killed after B's first run of chunks landed, long before its ~800 KB were written.
    assert len(partial) == 1 and 0 < partial[0].stat().st_size <= 200_000
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        assert engine.latest() == "A"
        assert_same(engine.load("A"), _state(1))
        with pytest.raises(CheckpointError, match="not a committed checkpoint"):
            engine.load("B")
        # The next run can take checkpoint B again.
        engine.save(_state(3), "B", version=2)
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        assert engine.latest() == "B"
        assert_same(engine.load("B"), _state(3))
        assert_same(engine.load("A"), _state(1))


def test_enospc_reaches_wait_snapshot_and_every_later_call(make_engine, fault, tmp_path):
    engine = make_engine(**TINY)  # snapshot (~1 MB) far larger than the cache: it needs the writer
    engine.save(_state(1), "A", version=1)
    engine.commit("A")
    engine.wait_persisted()
    fault(_enospc_for("B"))
    engine.save(_state(2, 250_000), "B", version=2)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        engine.wait_snapshot()
    assert "in time" not in str(info.value)  # the error itself, not a timeout
    with pytest.raises(CheckpointError, match="No space left on device"):
        engine.commit("B")
    with pytest.raises(CheckpointError, match="No space left on device"):
        engine.wait_persisted()
    with pytest.raises(CheckpointError, match="No space left on device"):
        engine.save(_state(3), "C", version=3)
    with pytest.raises(CheckpointError, match="No space left on device"):
        engine.shutdown(timeout=10)
    root = tmp_path / "ckpt"
    assert committed_names(root) == ["A"]
    assert read_manifest(str(root / "B")) is None
    err = json.loads((root / "B" / ".reports" / f"rank-00000.{engine.run_id}.error.json").read_text())
    assert "No space left on device" in err["error"]
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as reader:
        assert reader.latest() == "A"
        assert_same(reader.load("A"), _state(1))
        with pytest.raises(CheckpointError):
            reader.load("B")


def test_enospc_after_snapshot_reaches_wait_persisted(make_engine, fault, tmp_path):
    engine = make_engine(host_cache_size=0.01, chunk_size_mb=0.25)  # the whole snapshot fits the cache
    committed = threading.Event()  # the disk fills once the commit is asked for, not before
    fault(_enospc_for("B", after=committed))
    engine.save(_state(2), "B", version=2)
    engine.commit("B")
    committed.set()
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        engine.wait_snapshot()
        engine.wait_persisted()
    assert "in time" not in str(info.value)
    with pytest.raises(CheckpointError, match="No space left on device"):
        engine.save(_state(3), "C", version=3)
    assert committed_names(tmp_path / "ckpt") == []
    assert engine.latest() is None


def test_enospc_on_the_sidecar_write(make_engine, fault, tmp_path):
    engine = make_engine(**TINY)

    def hook(level, path, offset, nbytes):
        if path.endswith(".state.json"):
            raise OSError(errno.ENOSPC, "No space left on device (sidecar, injected)")

    fault(hook)
    engine.save(_state(1), "A", version=1)
    engine.commit("A")
    with pytest.raises(CheckpointError, match="sidecar, injected"):
        engine.wait_persisted()
    assert committed_names(tmp_path / "ckpt") == []


def test_on_failure_continue_abandons_only_the_failed_checkpoint(make_engine, fault, tmp_path):
    engine = make_engine(**TINY, on_failure="continue")
    fault(_enospc_for("B"))
    engine.save(_state(1), "A", version=1)
    engine.commit("A")
    engine.save(_state(2), "B", version=2)
    engine.commit("B")
    engine.save(_state(3), "C", version=3)
    engine.commit("C")
    engine.wait_persisted()  # B is abandoned, not fatal
    assert committed_names(tmp_path / "ckpt") == ["A", "C"]
    assert engine.latest() == "C"
    assert_same(engine.load("C"), _state(3))
    assert_same(engine.load("A"), _state(1))
    failed = [r for r in engine.telemetry.records if r["event"] == "failed"]
    assert [r["checkpoint"] for r in failed] == ["B"] and "No space left" in failed[0]["error"]


def _stuck_writer(fault):
    go = threading.Event()
    fault(lambda level, path, offset, nbytes: go.wait(60))
    return go


def test_stuck_file_system_fails_the_snapshot_with_a_clear_error(make_engine, fault):
    # Four cache slots, writes that never finish: the snapshot cannot get a slot and gives up
    # after persist_timeout_s with an error naming the cause, instead of hanging training.
    engine = make_engine(host_cache_size=4 * 4096 / 2 ** 30, chunk_size_mb=0.004, persist_timeout_s=1.0)
    go = _stuck_writer(fault)
    engine.save(_state(1, 50_000), "A", version=1)
    with pytest.raises(CheckpointError, match="no host cache slot was freed within 1s"):
        engine.wait_snapshot(timeout=30)
    go.set()
    with pytest.raises(CheckpointError, match="no host cache slot"):
        engine.save(_state(2), "B", version=2)
    assert engine.latest() is None


def test_shutdown_after_snapshot_failure_stops_every_thread(make_engine, fault):
    engine = make_engine(host_cache_size=4 * 4096 / 2 ** 30, chunk_size_mb=0.004, persist_timeout_s=1.0)
    go = _stuck_writer(fault)
    engine.save(_state(1, 50_000), "A", version=1)
    engine.commit("A")
    with pytest.raises(CheckpointError, match="no host cache slot"):
        engine.wait_persisted(timeout=30)
    go.set()
    with pytest.raises(CheckpointError):
        engine.shutdown(timeout=10)
    assert not engine.committer._thread.is_alive()


def test_a_shutdown_with_a_stuck_flush_ends_within_its_timeout(make_engine, fault):
    # The wait for the commit and the threads' stop share the one timeout, so a watchdog whose
    # timeout the engine's is ordered below (nvidia-resiliency-ext's rank monitor) never fires first.
    engine = make_engine(persist_timeout_s=60.0)
    go = _stuck_writer(fault)
    engine.save(_state(1, 50_000), "A", version=1)
    engine.commit("A")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="commit of A did not finish in time"):
        engine.shutdown(timeout=2)
    took = time.monotonic() - started
    go.set()
    assert took < 2 + 1.5, f"shutdown(timeout=2) took {took:.1f}s"
    assert engine.latest() is None
