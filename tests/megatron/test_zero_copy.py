"""The lazy snapshot reads the distributed optimizer's fp32 main params and Adam moments in place."""

import subprocess
from pathlib import Path

import pytest

from helpers.procs import torchrun_command
from helpers.trainer_runs import REPO, trainer_env

pytest.importorskip("megatron.core")


@pytest.mark.multiproc
def test_optimizer_state_is_snapshotted_without_copies():
    cmd = torchrun_command(1, str(Path(__file__).parent / "zero_copy_worker.py"))
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "optimizer shards alias live state" in proc.stdout
