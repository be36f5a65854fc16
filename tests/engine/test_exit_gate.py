"""The exit hook commits a save whose copies still wait for a collective (``CopyGate``), as the
README promises: two gloo ranks save behind a gate the next forward pass would open, then the
interpreter exits with no wait and no shutdown. Nothing is killed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, read_manifest

from helpers.procs import REPO, child_env, torchrun_command
from helpers.states import FAST

HERE = Path(__file__).resolve().parent


def _exit_run(root: Path, how: str, rc: int) -> str:
    cmd = torchrun_command(2, str(HERE / "_exit_gate_worker.py"), str(root), how)
    proc = subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=150)
    assert (proc.returncode == 0) == (rc == 0), proc.stderr[-6000:]
    return proc.stderr


def _expected(iteration: int) -> torch.Tensor:
    from _exit_gate_worker import shard  # noqa: E402 (the worker's own values)

    return torch.cat([shard(0, iteration), shard(1, iteration)])


def _loads(root: Path, iteration: int) -> None:
    name = f"iter_{iteration:07d}"
    manifest = read_manifest(str(root / name))
    assert manifest["version"] == iteration and manifest["world_size"] == 2
    with CheckpointEngine({"save_dir": str(root), **FAST}, read_only=True) as reader:
        assert reader.latest() == name
        for rank in (0, 1):
            got = reader.load(name, f"rank{rank:05d}")["param"]
            assert torch.equal(got.view(torch.int32), _expected(iteration).view(torch.int32))  # bit for bit


@pytest.mark.multiproc
def test_exit_hook_settles_and_commits_a_gated_save(tmp_path):
    log = _exit_run(tmp_path, "exit", 0)
    assert (tmp_path / "tracker.txt").read_text() == "2"
    _loads(tmp_path, 2)
    assert "settled here (its collective ran), copied" in log


@pytest.mark.multiproc
def test_after_an_exception_only_a_gathered_save_commits(tmp_path):
    failed, gathered = tmp_path / "failed", tmp_path / "gathered"
    log = _exit_run(failed, "raise", 1)
    assert (failed / "tracker.txt").read_text() == "1"  # iteration 2 never committed: no collective at exit
    assert not (failed / "iter_0000002" / "manifest.json").exists()
    assert "the process ended on an exception, where no collective may run" in log
    _loads(failed, 1)
    _exit_run(gathered, "raise-gathered", 1)
    assert (gathered / "tracker.txt").read_text() == "2"
    _loads(gathered, 2)
