"""Two storage levels: files go to the node-local directory first, are staged to the shared one,
the manifest is committed on the shared level only; loads prefer a complete local copy."""

from __future__ import annotations

import errno
import shutil

import pytest
import torch

from megatron_ext.engine import CheckpointError, read_manifest

from helpers.damage import truncate_to
from helpers.states import TINY, assert_same, clone_state, committed_names, seeded_state


def _state(i: int) -> dict:
    return seeded_state(i, 60_000, (70, 90), b=torch.arange(100, dtype=torch.int16))


def test_files_on_both_levels_manifest_on_shared_load_prefers_local(make_engine, tmp_path):
    local, shared = tmp_path / "local", tmp_path / "shared"
    engine = make_engine(**TINY, local_dir=str(local), save_dir=str(shared))
    state = _state(1)
    expected = clone_state(state)
    engine.save(state, "c1", "model", version=1)
    engine.save({"m": torch.ones(5)}, "c1", "optim", version=1)
    engine.commit("c1")
    engine.wait_persisted()

    manifest = read_manifest(str(shared / "c1"))
    assert manifest is not None and read_manifest(str(local / "c1")) is None
    for entry in manifest["files"].values():
        for key, size in (("tensor_file", "size"), ("state_file", "state_size")):
            assert (local / entry[key]).read_bytes() == (shared / entry[key]).read_bytes()
            assert (shared / entry[key]).stat().st_size == entry[size]
    report = f"rank-00000.{engine.run_id}.json"
    assert (local / "c1" / ".reports" / report).exists() and (shared / "c1" / ".reports" / report).exists()
    assert committed_names(shared) == ["c1"] and engine.latest() == "c1"

    assert_same(engine.load("c1", "model"), expected)
    assert engine.last_load_level == "local"
    ckpt = engine.open_checkpoint("c1")
    assert_same(ckpt.reader("model").state(), expected)
    assert ckpt.levels_used == {"local"}

    shutil.rmtree(local / "c1")
    assert_same(engine.load("c1", "model"), expected)
    assert engine.last_load_level == "shared"
    with pytest.raises(CheckpointError, match="not complete on the node-local level"):
        engine.load("c1", "model", level="local")


def test_truncated_local_copy_falls_back_to_shared(make_engine, tmp_path):
    local, shared = tmp_path / "local", tmp_path / "shared"
    engine = make_engine(**TINY, local_dir=str(local), save_dir=str(shared))
    engine.save(_state(2), "c1", version=2)
    engine.commit("c1")
    engine.wait_persisted()
    entry = read_manifest(str(shared / "c1"))["files"]["rank00000"]
    truncate_to(local / entry["tensor_file"], entry["size"] // 2)
    assert_same(engine.load("c1"), _state(2))
    assert engine.last_load_level == "shared"


def test_failure_staging_to_shared_is_reported_and_not_committed(make_engine, fault, tmp_path):
    local, shared = tmp_path / "local", tmp_path / "shared"
    engine = make_engine(**TINY, local_dir=str(local), save_dir=str(shared))

    def hook(level, path, offset, nbytes):
        if level == "shared":
            raise OSError(errno.EIO, "Input/output error (shared level, injected)")

    fault(hook)
    engine.save(_state(3), "c1", version=3)
    engine.commit("c1")
    with pytest.raises(CheckpointError, match="shared level, injected"):
        engine.wait_persisted()
    assert committed_names(shared) == []
    assert any(p.name.endswith(".safetensors") for p in (local / "c1").iterdir())  # local level was fine


def test_a_restart_removes_local_copies_the_shared_level_never_committed(make_engine, tmp_path):
    """A crash can leave on a node's local level what the shared level never committed (a save in
    flight) and a checkpoint renamed away by retention but not yet deleted: the next engine on that
    node removes both before it writes, and keeps the committed checkpoints' copies and what is not
    the job's."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    first = make_engine(**TINY, local_dir=str(local), save_dir=str(shared))
    for name in ("c1", "c2"):
        first.save(_state(1), name, "model", version=int(name[1]))
        first.commit(name)
    first.wait_persisted()
    first.shutdown()
    shutil.copytree(local / "c2", local / "c3")  # a copy whose commit never came
    shutil.copytree(local / "c1", local / ".c0.deleting")  # retention's rename, then the crash
    (local / "notes").mkdir()  # not the job's: no reports, no data files of its runs
    (shared / "c2" / "manifest.json").unlink()  # c2's commit undone on the shared level

    make_engine(**TINY, local_dir=str(local), save_dir=str(shared))
    assert sorted(p.name for p in local.iterdir() if p.is_dir()) == ["c1", "notes"]
