"""An in-process restart of Megatron-LM's own loop with ``--use-datastates`` (issue: the resiliency stack).

nvidia-resiliency-ext's in-process restart (``--inprocess-restart``) cannot run on CPU ranks (its
health check and abort are CUDA's), so the harness does what it does
(``megatron_lm._install_inprocess_restart``): every rank raises a fault right after iteration 3's
save call, the process groups and Megatron-LM's global state are destroyed, and ``pretrain`` runs
again in the same processes over a fresh store prefix. The engine of the failed attempt must be
abandoned at the new attempt's first checkpoint call (its threads and I/O worker ended, its host
cache freed, its locks released, nothing more committed), a new one must start, and the steps of
both attempts must be the uninterrupted run's bit for bit. What only a GPU run exercises: NVRx's
own abort of NCCL communicators and its CUDA health check (docs/MEGATRON.md).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from helpers.megatron_lm_runs import DATASTATES, STEP_FIELDS, assert_same_trajectory, read_tracker, run, trajectory
from helpers.procs import child_env, python_command

ITERS = 6
FAULT_AT = 3
NPROC = 2
COMMON = ["--bf16", "--use-distributed-optimizer", "--save-interval", "1", "--train-iters", str(ITERS)]


@pytest.mark.parametrize("late_copies", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["copies_done", "copies_held"])
def test_inprocess_restart_abandons_the_engine_and_resumes_bit_for_bit(checkout, tmp_path, late_copies):
    """``copies_held``: each save's copies wait for the optimizer's next wait, which the fault comes
    before, so iteration 3's checkpoint is open when the engine is abandoned: it must not commit."""
    def levels(where):
        return ["--save", str(where / "shared"), "--load", str(where / "shared"), *DATASTATES,
                "--datastates-local-dir", str(where / "local")]

    uninterrupted = trajectory(run(checkout, NPROC, [*COMMON, *levels(tmp_path / "a")], tmp_path / "a", "run"))
    restarted = run(checkout, NPROC, [*COMMON, *levels(tmp_path / "b")], tmp_path / "b", "run",
                    inprocess_fault_at=FAULT_AT, late_copies=late_copies)

    log = restarted.log
    assert log.count("injected fault after iteration 3's save call; restarting in this process") == NPROC, log[-3000:]
    stopped = re.findall(r"\[datastates\] rank (\d): in-process restart: the previous attempt's engine stopped "
                         r"\(open checkpoints abandoned: ([^;]*); threads still running: none; host cache freed\)",
                         log)
    assert sorted(rank for rank, _ in stopped) == [str(r) for r in range(NPROC)], log[-3000:]
    if late_copies:
        assert all("iter_0000003" in abandoned for _, abandoned in stopped), stopped
    iterations = [r["iteration"] for r in restarted.records]
    resumed_from = iterations[FAULT_AT] - 1  # the second attempt's first step follows its checkpoint
    assert iterations == [*range(1, FAULT_AT + 1), *range(resumed_from + 1, ITERS + 1)]
    assert FAULT_AT - 2 <= resumed_from <= (FAULT_AT - 1 if late_copies else FAULT_AT)
    steps = {r["iteration"]: tuple(r.get(f) for f in STEP_FIELDS) for r in restarted.records[:FAULT_AT]}
    steps.update(trajectory(restarted))
    assert_same_trajectory(dict(sorted(steps.items())), uninterrupted, "in-process restart vs uninterrupted")
    assert read_tracker(tmp_path / "b" / "shared") == str(ITERS)
    verify = subprocess.run(python_command("-m", "megatron_ext", "verify", str(tmp_path / "b" / "shared")),
                            capture_output=True, text=True, timeout=300, env=child_env())
    assert verify.returncode == 0, verify.stdout + verify.stderr
