"""Crash consistency of the reference trainer: SIGKILL at random moments, restart, verify, compare.

Four ranks (TP=2 x DP=2) checkpoint every iteration with a node-local and a shared level, and
are all SIGKILLed at a random moment: during a copy, a flush, a commit, the tracker update or the
copy to the shared level, wherever the clock falls. After each kill the newest committed
checkpoint must verify (sizes and checksums) and the resumed run must continue bit-identical to
an uninterrupted run. CI runs a few trials; ``--run-slow`` runs the nightly 50.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from helpers.procs import kill_job, python_command
from helpers.trainer_runs import COMMON, REPO, run_trainer, trainer_command, trainer_env

pytest.importorskip("megatron.core")

ITERS = 40
PARALLEL = ["--tensor-model-parallel-size", "2", "--train-iters", str(ITERS)]
CI_TRIALS = 2
NIGHTLY_TRIALS = 50


def _datastates(tmp: Path) -> list[str]:
    return ["--save", str(tmp / "shared"), "--save-interval", "1", "--use-datastates",
            "--datastates-host-cache-size", "0.02", "--datastates-local-dir", str(tmp / "local")]


def _killed_run(tmp: Path, rng: random.Random) -> float:
    """Start the trainer, wait until it trains, SIGKILL the whole process group at a random moment."""
    log = tmp / "crashed.jsonl"
    cmd = trainer_command(4, *COMMON, *PARALLEL, *_datastates(tmp), "--log-json", str(log))
    proc = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not (log.exists() and log.read_text().count("\n") >= 2):
        assert proc.poll() is None, "trainer ended before it could be killed"
        assert time.monotonic() < deadline, "trainer did not start training"
        time.sleep(0.05)
    delay = rng.uniform(0.0, 2.0)
    time.sleep(delay)
    kill_job(proc)
    return delay


def _trial(tmp: Path, reference: dict[int, str], rng: random.Random) -> dict:
    tmp.mkdir()
    delay = _killed_run(tmp, rng)
    tracker = tmp / "shared" / "latest_checkpointed_iteration.txt"
    committed = int(tracker.read_text()) if tracker.exists() else 0
    if committed:
        verify = subprocess.run(python_command("-m", "megatron_ext", "verify", str(tmp / "shared"),
                                                "--iteration", str(committed)), capture_output=True, text=True, timeout=120)
        assert verify.returncode == 0, verify.stdout
    resumed = run_trainer(4, [*PARALLEL, *_datastates(tmp), "--load", str(tmp / "shared")], tmp / "resumed.jsonl")
    losses = {r["iteration"]: r["loss"] for r in resumed}
    assert sorted(losses) == list(range(committed + 1, ITERS + 1))
    assert all(losses[i] == reference[i] for i in losses), "resumed run diverged"
    return {"kill_after_s": round(delay, 3), "committed": committed}


def _run_trials(tmp_path: Path, count: int) -> list[dict]:
    reference = {r["iteration"]: r["loss"] for r in run_trainer(4, PARALLEL, tmp_path / "reference.jsonl")}
    rng = random.Random(int(os.environ.get("CRASH_TRIAL_SEED", "20261122")))
    results = [_trial(tmp_path / f"trial{n:02d}", reference, rng) for n in range(count)]
    summary = tmp_path.parent / f"crash-trials-{count}.json"
    summary.write_text(json.dumps(results))
    print(f"crash trials: {len(results)}, lost or corrupted checkpoints: 0, results: {results}")
    return results


@pytest.mark.multiproc
def test_crash_trials_ci(tmp_path):
    assert len(_run_trials(tmp_path, CI_TRIALS)) == CI_TRIALS


@pytest.mark.slow
@pytest.mark.multiproc
def test_crash_trials_nightly(tmp_path):
    assert len(_run_trials(tmp_path, NIGHTLY_TRIALS)) == NIGHTLY_TRIALS
