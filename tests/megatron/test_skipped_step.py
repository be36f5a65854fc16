"""``--qk-clip`` edits weights right after ``optimizer.step()``, also on a step the fp16 scaler skips.

A skipped step never reaches the inner step, where the lazy wait sits; with ``qk_clip`` the
adapter also waits when ``step`` returns, so the edit cannot reach a snapshot still copying.
Megatron-LM's ``--qk-clip`` itself needs Transformer Engine >= 2.9 (not on CPUs), so this runs
the adapter with a real fp16 megatron-core optimizer and the flag set, and checks the
snapshot's state when ``step`` returns: complete with the flag, still copying without it.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import REPO

pytest.importorskip("megatron.core")


def _run(mode: str, save_dir: Path) -> str:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "skipped_step_worker.py"), mode, str(save_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "skipped: True" in proc.stdout  # the scaler found the overflow
    return proc.stdout


def test_qk_clip_waits_for_the_snapshot_after_a_skipped_step(tmp_path):
    assert "pending-after-step: False" in _run("qk_clip", tmp_path / "qk_clip")
    # Without --qk-clip nothing edits the weights there, and nothing waits: the copy is still going.
    assert "pending-after-step: True" in _run("plain", tmp_path / "plain")
