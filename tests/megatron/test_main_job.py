"""The main job (scripts/run_main.sh -> megatron-ext main-job): which trainer it runs, and that it says so.

* without the Megatron-LM checkout it falls back to the reference trainer and says so in its
  first line; ``--trainer megatron`` refuses instead;
* ``--json``: one JSON object on stdout, the progress on stderr (the reference trainer, 2 ranks; slow);
* with the checkout (slow, about 3 minutes): Megatron-LM's own pretrain_gpt.py at TP2 x PP2 x
  DP2, SIGKILL, resume, and the bit-exact verdict.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env_without_checkout(tmp_path: Path) -> dict:
    """find_checkout() fails fast: an empty cache and a source that does not exist."""
    return dict(os.environ, MEGATRON_EXT_CACHE=str(tmp_path / "empty-cache"),
                MEGATRON_LM_DIR=str(tmp_path / "no-such-Megatron-LM"), OMP_NUM_THREADS="1")


def test_without_checkout_the_first_line_says_it_falls_back(tmp_path):
    cmd = [sys.executable, "-m", "megatron_ext", "main-job", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, env=_env_without_checkout(tmp_path), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        first = ""
        while not first.startswith("[main-job]") and time.monotonic() < deadline:
            first = proc.stdout.readline()
            if not first and proc.poll() is not None:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the reference runs are not what this test is about
        proc.wait(timeout=30)
        proc.stdout.close()
    assert first.startswith("[main-job] FALLBACK to the reference trainer, not Megatron-LM's pretrain_gpt.py: "
                            "Megatron-LM checkout not available: run `MEGATRON_LM_DIR="), first
    assert "is not a directory" in first, first


def test_trainer_megatron_refuses_to_fall_back(tmp_path):
    res = subprocess.run([sys.executable, "-m", "megatron_ext", "main-job", "--trainer", "megatron",
                          "--out", str(tmp_path / "out")], env=_env_without_checkout(tmp_path), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout.startswith("[main-job] error: --trainer megatron, but Megatron-LM checkout not available"), \
        res.stdout


@pytest.mark.slow  # three cold torchrun jobs (~25 s): the default suite's budget goes to Megatron-LM's own loop
def test_json_is_one_object_on_stdout_with_the_progress_on_stderr(tmp_path):
    res = subprocess.run([sys.executable, "-m", "megatron_ext", "main-job", "--trainer", "reference", "--ranks", "2",
                          "--iters", "3", "--crash-at", "2", "--json", "--out", str(tmp_path / "out")], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["passed"] is True and summary["mismatches"] == []
    assert (summary["trainer"], summary["ranks"], summary["iterations"], summary["crash_at"]) == ("reference", 2, 3, 2)
    assert 1 <= summary["committed_at_kill"] <= 2 and summary["steps_compared"] == 2 + 3 - summary["committed_at_kill"]
    assert summary["blocked_ms_mean"] > 0
    assert res.stderr.startswith("[main-job] FALLBACK to the reference trainer") and "[main-job] 3/3 resume" in res.stderr


@pytest.mark.slow
def test_main_job_runs_megatron_lm_and_passes(tmp_path):
    from megatron_ext.testing.megatron_lm import find_checkout

    checkout, reason = find_checkout()
    if checkout is None:
        pytest.skip(reason)
    res = subprocess.run([sys.executable, "-m", "megatron_ext", "main-job", "--trainer", "megatron",
                          "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                         timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = res.stdout
    assert res.returncode == 0, out[-5000:] + res.stderr[-3000:]
    lines = out.splitlines()
    assert lines[0].startswith(f"[main-job] trainer: Megatron-LM's own pretrain_gpt.py from {checkout}")
    assert "[main-job] PASS: loss and grad norm of all 10 iterations" in out
    assert "FALLBACK" not in out
    assert re.search(r"\n    kill: +SIGKILL on every rank after iteration 6; newest committed checkpoint then: "
                     r"iteration [1-6]\n", out), out
    assert "training blocked" in out
