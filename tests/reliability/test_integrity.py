"""Integrity and retention on real files: `megatron-ext verify`, load checks, retention, partial cleanup."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError

from helpers.damage import cut_tail, flip_bits
from helpers.procs import python_command

WORLD = 2


def _save(root: Path, checkpoints: list[int], **config) -> None:
    """Two ranks' worth of files per checkpoint, written by two engines sharing one run id."""
    store = dist.HashStore()
    engines = [CheckpointEngine({"save_dir": str(root), "host_cache_size": 0.01, **config},
                                rank=r, world_size=WORLD, run_id="0123456789ab", commit_store=store) for r in range(WORLD)]
    try:
        for i in checkpoints:
            for r, engine in enumerate(engines):
                engine.save({"w": torch.arange(50_000, dtype=torch.float32) * i + r, "i": i}, f"iter_{i:07d}",
                            f"rank{r}", version=i)
                engine.commit(f"iter_{i:07d}")
            for engine in engines:
                engine.wait_persisted()
    finally:
        for engine in engines:
            engine.shutdown()


def _verify(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(python_command("-m", "megatron_ext", "verify", str(root), *args),
                          capture_output=True, text=True, timeout=120)


def _tensor_file(root: Path, iteration: int, rank: int) -> Path:
    return next((root / f"iter_{iteration:07d}").glob(f"rank{rank}.*.safetensors"))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    _save(tmp_path, [1, 2])
    return tmp_path


def test_verify_passes_an_intact_checkpoint(saved):
    result = _verify(saved)
    assert result.returncode == 0 and "2 checkpoint(s) verified" in result.stdout


@pytest.mark.parametrize("damage, expected", [
    ("flip", "checksum mismatch"),
    ("truncate", "bytes, the manifest says"),
    ("delete", "missing (rank 1)"),
])
def test_verify_and_load_catch_damage(saved, damage, expected):
    path = _tensor_file(saved, 2, 1)
    if damage == "flip":
        flip_bits(path, -10, 0x40)
    elif damage == "truncate":
        cut_tail(path, 4096)
    else:
        path.unlink()
    result = _verify(saved, "--iteration", "2")
    assert result.returncode == 1
    assert expected in result.stdout and f"first bad file: iter_0000002/{path.name}" in result.stdout
    assert _verify(saved, "--iteration", "1").returncode == 0
    with CheckpointEngine({"save_dir": str(saved), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        with pytest.raises(CheckpointError):
            engine.load("iter_0000002", "rank1")
        assert engine.load("iter_0000001", "rank1")["i"] == 1  # the previous one is intact


def test_verify_catches_a_manifest_from_another_run(saved, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    store = dist.HashStore()
    engines = [CheckpointEngine({"save_dir": str(other), "host_cache_size": 0.01}, rank=r, world_size=WORLD,
                                run_id="ffffffffffff", commit_store=store) for r in range(WORLD)]
    for r, engine in enumerate(engines):
        engine.save({"w": torch.zeros(10)}, "iter_0000002", f"rank{r}", version=2)
        engine.commit("iter_0000002")
    for engine in engines:
        engine.shutdown()
    shutil.copy(other / "iter_0000002" / "manifest.json", saved / "iter_0000002" / "manifest.json")
    result = _verify(saved, "--iteration", "2")
    assert result.returncode == 1 and "missing" in result.stdout


def test_verify_reports_an_uncommitted_checkpoint(saved):
    (saved / "iter_0000002" / "manifest.json").unlink()
    result = _verify(saved, "--iteration", "2")
    assert result.returncode == 1 and "not committed" in result.stdout


def test_retention_keeps_last_k_and_every_mth(tmp_path):
    _save(tmp_path, list(range(1, 11)), keep_last=2, keep_every=4)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_"))
    assert kept == ["iter_0000004", "iter_0000008", "iter_0000009", "iter_0000010"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".datastates.lock"]  # nothing hidden left
    assert _verify(tmp_path).returncode == 0


def test_partial_checkpoints_are_removed_at_start(saved):
    partial = saved / "iter_0000003"
    (partial / ".reports").mkdir(parents=True)
    (partial / "rank0.0123456789ab.safetensors").write_bytes(b"half a file")
    unrelated = saved / "notes"
    unrelated.mkdir()
    CheckpointEngine({"save_dir": str(saved), "host_cache_size": 0.001}, rank=0, world_size=1).shutdown()
    assert not partial.exists() and unrelated.exists()
    assert (saved / "iter_0000002" / "manifest.json").exists()


def test_loading_never_runs_code_from_the_checkpoint(saved):
    """A sidecar edited to name an arbitrary class is refused, not imported or called."""
    state_file = next((saved / "iter_0000001").glob("rank0.*.state.json"))
    doc = json.loads(state_file.read_text())
    doc["state"]["i"] = {"$obj": ["os", "system", {"x": 1}]}
    state_file.write_text(json.dumps(doc))
    with CheckpointEngine({"save_dir": str(saved), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        with pytest.raises(CheckpointError, match="bytes, the manifest says"):  # its size changed, so no checksum
            engine.load("iter_0000001", "rank0")
        from megatron_ext.engine.errors import UnsafeCheckpointError
        from megatron_ext.engine.format.codec import decode

        with pytest.raises(UnsafeCheckpointError):
            decode(doc["state"], lambda name: torch.zeros(1))
