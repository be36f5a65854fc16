"""Graceful stop and fallback on the reference trainer (2 CPU ranks, --use-datastates)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.damage import overwrite
from helpers.procs import job_ranks
from helpers.trainer_runs import COMMON, REPO, run_trainer, trainer_command, trainer_env

pytest.importorskip("megatron.core")


def _datastates(root: Path, interval: int = 1) -> list[str]:
    return ["--save", str(root), "--save-interval", str(interval), "--use-datastates",
            "--datastates-host-cache-size", "0.02"]


@pytest.mark.multiproc
def test_sigusr1_checkpoints_commits_and_exits(tmp_path):
    log = tmp_path / "run.jsonl"
    cmd = trainer_command(2, *COMMON, "--train-iters", "100000", *_datastates(tmp_path / "ckpt", interval=1000),
                          "--exit-signal-handler", "--log-json", str(log))
    proc = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    job_ranks(proc.pid)[-1].send_signal(signal.SIGUSR1)  # one rank is signalled; all stop at the same iteration
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    last = max(json.loads(line)["iteration"] for line in log.read_text().splitlines())
    assert last < 1000  # no regular checkpoint was due: this one exists because of the signal
    assert int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) == last
    assert "exit signal received" in out


@pytest.mark.multiproc
def test_damaged_newest_checkpoint_falls_back_only_when_asked(tmp_path):
    root = tmp_path / "ckpt"
    run_trainer(2, ["--train-iters", "4", *_datastates(root)], tmp_path / "first.jsonl")
    victim = next((root / "iter_0000004").glob("rank00001.*.safetensors"))
    overwrite(victim, -64, b"\xff" * 8)
    resume = ["--train-iters", "6", *_datastates(root), "--load", str(root)]
    # Without the flag every rank stops with one message that names the file and the remedy.
    failed = subprocess.run(trainer_command(2, *COMMON, *resume), cwd=REPO, env=trainer_env(), capture_output=True,
                            text=True, timeout=300)
    assert failed.returncode != 0
    assert "iter_0000004" in failed.stderr and "--datastates-load-fallback" in failed.stderr
    records = run_trainer(2, [*resume, "--datastates-load-fallback"], tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in records] == [4, 5, 6]  # resumed from iteration 3


@pytest.mark.multiproc
def test_a_checkpoint_of_another_model_is_named_as_such_not_as_damage(tmp_path):
    """Loading a checkpoint into a model of other shapes says so and does not suggest
    --datastates-load-fallback (every older checkpoint of that run would not fit either)."""
    root = tmp_path / "ckpt"
    run_trainer(2, ["--train-iters", "2", *_datastates(root)], tmp_path / "first.jsonl")
    for extra in ([], ["--datastates-load-fallback"]):
        failed = subprocess.run(trainer_command(2, *COMMON, "--train-iters", "4", "--hidden-size", "128",
                                                *_datastates(tmp_path / "other"), "--load", str(root), *extra),
                                cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=300)
        assert failed.returncode != 0
        assert "iter_0000002" in failed.stderr and "does not fit this model" in failed.stderr, failed.stderr[-3000:]
        assert "loads the previous one instead" not in failed.stderr
        assert "falling back to" not in failed.stderr  # iteration 1 would not fit either: not tried
