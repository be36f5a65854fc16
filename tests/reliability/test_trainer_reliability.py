"""Graceful stop and fallback on the reference trainer (2 CPU ranks, --use-datastates)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from launch import COMMON, REPO, free_port, run_trainer  # noqa: E402

pytest.importorskip("megatron.core")


def _datastates(root: Path, interval: int = 1) -> list[str]:
    return ["--save", str(root), "--save-interval", str(interval), "--use-datastates",
            "--datastates-host-cache-size", "0.02"]


@pytest.mark.multiproc
def test_sigusr1_checkpoints_commits_and_exits(tmp_path):
    log = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "megatron_ext.testing.reference_trainer", *COMMON,
           "--train-iters", "100000", *_datastates(tmp_path / "ckpt", interval=1000), "--exit-signal-handler",
           "--log-json", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    workers[-1].send_signal(signal.SIGUSR1)  # one rank is signalled; all stop at the same iteration
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
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size - 64)
        f.write(b"\xff" * 8)
    resume = ["--train-iters", "6", *_datastates(root), "--load", str(root)]
    # Without the flag every rank stops with one message that names the file and the remedy.
    failed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             "-m", "megatron_ext.testing.reference_trainer", *COMMON, *resume],
                            cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=300)
    assert failed.returncode != 0
    assert "iter_0000004" in failed.stderr and "--datastates-load-fallback" in failed.stderr
    records = run_trainer(2, [*resume, "--datastates-load-fallback"], tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in records] == [4, 5, 6]  # resumed from iteration 3
