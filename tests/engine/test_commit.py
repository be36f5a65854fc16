"""The commit protocol: only a manifest makes a checkpoint; ``latest()`` follows versions; a
checkpoint id saved again by a new run replaces the old one atomically; ``shutdown`` (explicit,
context manager or at interpreter exit) commits whatever was saved."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed, read_manifest

from helpers.damage import flip_bits
from helpers.procs import run_worker
from helpers.states import FAST, TINY, assert_same, clone_state, committed_names, seeded_state

LIFECYCLE = Path(__file__).resolve().parent / "_lifecycle_worker.py"


def _state(i: int) -> dict:
    return seeded_state(i, i=torch.arange(i, i + 50))


# ---------------------------------------------------------------------------- uncommitted
def test_uncommitted_checkpoint_of_a_killed_process_is_never_loaded(tmp_path):
    root = tmp_path / "ckpt"
    run_worker(LIFECYCLE, "killed-before-commit", str(root), check_rc=-9)
    files = sorted(p.name for p in (root / "B").iterdir())
    assert any(f.endswith(".safetensors") for f in files) and "manifest.json" not in files
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        assert engine.latest() == "A"
        assert [name for name, _ in list_committed(str(root))] == ["A"]
        with pytest.raises(CheckpointError, match="not a committed checkpoint"):
            engine.load("B")
        assert_same(engine.load("A"), _state(1))


def test_reported_but_unmanifested_checkpoint_is_removed_at_start(tmp_path):
    # Rank 0 of a 2-rank world whose peer never reports: the rank report exists, the manifest
    # never does. A killed run leaves exactly that; the next run's rank 0 removes it at start-up.
    root = tmp_path / "ckpt"
    run_worker(LIFECYCLE, "killed-after-rank-report", str(root), check_rc=-9)
    assert (root / "P" / ".reports").is_dir() and not (root / "P" / "manifest.json").exists()
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        assert not (root / "P").exists()
        assert engine.latest() is None
        with pytest.raises(CheckpointError):
            engine.load("P")


def test_load_of_unknown_or_missing_names_raises(make_engine):
    engine = make_engine(**TINY)
    engine.save(_state(1), "A", "model")
    engine.commit("A")
    engine.wait_persisted()
    with pytest.raises(CheckpointError, match="no file 'other'"):
        engine.load("A", "other")
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        engine.load("nope")


def test_corrupted_data_file_is_detected_at_load(make_engine, tmp_path):
    engine = make_engine(**TINY)
    engine.save(_state(1), "A")
    engine.commit("A")
    engine.wait_persisted()
    manifest = read_manifest(str(tmp_path / "ckpt" / "A"))
    path = tmp_path / "ckpt" / manifest["files"]["rank00000"]["tensor_file"]
    flip_bits(path, -5, 0xFF)
    with pytest.raises(CheckpointError, match="checksum"):
        engine.load("A")


# ---------------------------------------------------------------------------- latest()
def test_latest_orders_by_version_not_by_name_or_commit_order(make_engine):
    engine = make_engine(**TINY)
    assert engine.latest() is None
    for name, version in (("step10", 10), ("step9", 9), ("step2", 2)):
        engine.save({"v": torch.tensor(version)}, name, version=version)
        engine.commit(name)
        engine.wait_persisted()
    assert engine.latest() == "step10"
    engine.save({"v": torch.tensor(11)}, "step11", version=11)
    engine.commit("step11")
    engine.wait_persisted()
    assert engine.latest() == "step11"
    assert [n for n, _ in list_committed(engine.config.save_dir)] == ["step2", "step9", "step10", "step11"]


def test_on_committed_runs_with_the_durable_manifest(make_engine, tmp_path):
    engine = make_engine(**TINY)
    seen = []
    engine.save(_state(3), "A", version=3)
    job = engine.commit("A", on_committed=lambda m: seen.append(
        (m, (tmp_path / "ckpt" / "A" / "manifest.json").exists())))
    engine.wait_persisted()
    assert job.settled.is_set()
    ((manifest, existed),) = seen
    assert existed and manifest["version"] == 3 and manifest["run_id"] == engine.run_id
    on_disk = read_manifest(str(tmp_path / "ckpt" / "A"))
    # the callback gets the header; the file list is read from the manifest file when asked for
    assert "files" not in manifest and manifest["files"] == on_disk["files"] and manifest == on_disk


# ---------------------------------------------------------------------------- re-saving
def test_resave_by_new_run_replaces_atomically_and_cleans_old_files(tmp_path, make_engine, fault):
    root = tmp_path / "ckpt"
    first = make_engine(**TINY)
    first.save(_state(1), "A", version=1)
    first.commit("A")
    first.shutdown()
    old_files = sorted(p.name for p in (root / "A").iterdir() if first.run_id in p.name)
    assert len(old_files) == 2

    go, entered = threading.Event(), threading.Event()

    def hold(level, path, offset, nbytes):
        entered.set()
        assert go.wait(60)

    fault(hold)
    second = make_engine(**TINY)
    assert second.run_id != first.run_id
    second.save(_state(2), "A", version=1)
    second.commit("A")
    assert entered.wait(30)
    # While the new run is writing, the committed checkpoint is still the old one, intact.
    reader = make_engine(**TINY, read_only=True)
    assert read_manifest(str(root / "A"))["run_id"] == first.run_id
    assert_same(reader.load("A"), _state(1))
    go.set()
    second.wait_persisted()
    manifest = read_manifest(str(root / "A"))
    assert manifest["run_id"] == second.run_id
    names = sorted(p.name for p in (root / "A").iterdir() if p.is_file())
    assert not any(first.run_id in n for n in names), names  # old run's data files removed
    assert any(second.run_id in n for n in names)
    assert_same(reader.load("A"), _state(2))


def test_resave_same_id_in_same_run_never_damages_the_committed_checkpoint(tmp_path, make_engine, fault):
    root = tmp_path / "ckpt"
    engine = make_engine(**TINY, on_failure="continue")
    engine.save(_state(1), "A", version=1)
    engine.commit("A")
    engine.wait_persisted()

    def enospc(level, path, offset, nbytes):
        if offset >= 2 * 4096:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    fault(enospc)
    try:
        engine.save(_state(2), "A", version=1)  # a second attempt at A, which fails to flush
        engine.commit("A")
        engine.wait_persisted()
    except CheckpointError:
        pass
    reader = make_engine(**TINY, read_only=True)
    assert_same(reader.load("A"), _state(1))


# ---------------------------------------------------------------------------- shutdown
def test_context_manager_commits_what_was_saved(tmp_path):
    root = tmp_path / "ckpt"
    state = _state(4)
    expected = clone_state(state)
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        engine.save(state, "A", version=4)  # no commit, no wait
    assert committed_names(root) == ["A"]
    with pytest.raises(CheckpointError, match="after shutdown"):
        engine.save(state, "B")
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        assert_same(engine.load("A"), expected)


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "never_committed"])
def test_interpreter_exit_commits_pending_checkpoint(tmp_path, commit):
    root = tmp_path / "ckpt"
    run_worker(LIFECYCLE, "exit-without-shutdown", str(root), "commit" if commit else "no-commit")
    assert committed_names(root) == ["A", "B"]
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as engine:
        assert engine.latest() == "B"
        assert_same(engine.load("B"), _state(7))
        assert_same(engine.load("A"), _state(1))
    manifest = json.loads((root / "B" / "manifest.json").read_text())
    assert manifest["version"] == 7 and list(manifest["files"]) == ["rank00000"]


def test_shutdown_is_idempotent_and_save_after_it_raises(make_engine):
    engine = make_engine(**TINY)
    engine.save(_state(1), "A")
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(CheckpointError):
        engine.save(_state(2), "B")
    assert engine.latest() == "A"


def test_save_rejects_bad_names_and_duplicates(make_engine):
    engine = make_engine(**TINY)
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            engine.save({"x": torch.ones(1)}, "A", bad)
    for bad in ("", ".A", "x/y"):
        with pytest.raises(ValueError):
            engine.save({"x": torch.ones(1)}, bad)
    engine.save({"x": torch.ones(1)}, "A", "n", version=1)
    with pytest.raises(CheckpointError, match="already has a file"):
        engine.save({"x": torch.ones(1)}, "A", "n", version=1)
    with pytest.raises(CheckpointError, match="version"):
        engine.save({"x": torch.ones(1)}, "A", "m", version=2)
    engine.commit("A")
    engine.wait_persisted()
    assert engine.latest() == "A"
    assert list(engine.open_checkpoint("A").manifest["files"]) == ["n"]


def test_saving_a_committed_id_again_in_the_same_run_replaces_it(tmp_path, make_engine):
    """Megatron-LM saves one iteration twice (batch-size ramp-up, rerun state machine): the later wins."""
    root = tmp_path / "ckpt"
    engine = make_engine(**TINY)
    engine.save(_state(1), "A", version=1)
    engine.commit("A")  # not waited for: the second save waits for this commit itself
    engine.save(_state(2), "A", version=1)
    engine.commit("A")
    engine.wait_persisted()
    manifest = engine.open_checkpoint("A").manifest
    assert manifest["run_id"] != engine.run_id  # the second attempt's own tag
    assert_same(engine.load("A"), _state(2))
    data_files = sorted(n for n in os.listdir(root / "A") if n.endswith((".safetensors", ".state.json")))
    assert data_files == sorted(os.path.basename(manifest["files"]["rank00000"][k]) for k in ("tensor_file", "state_file"))
    engine.save(_state(3), "A", version=1)  # a third time, after the second was committed
    engine.commit("A")
    engine.wait_persisted()
    assert_same(make_engine(read_only=True, **TINY).load("A"), _state(3))
