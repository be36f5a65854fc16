"""The lazy snapshot reads the distributed optimizer's fp32 main params and Adam moments in place."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import REPO, free_port

pytest.importorskip("megatron.core")


@pytest.mark.multiproc
def test_optimizer_state_is_snapshotted_without_copies():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(Path(__file__).parent / "zero_copy_worker.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "optimizer shards alias live state" in proc.stdout
