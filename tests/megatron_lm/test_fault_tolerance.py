"""Megatron-LM's own loop under nvidia-resiliency-ext's ``ft_launcher`` with ``--enable-ft-package --use-datastates``.

The real launcher and rank monitors (NVRx 0.4.1, the newest the registry has for Python 3.12; the
harness bridges it to Megatron-LM core_v0.19.0, ``megatron_lm._hide_old_nvrx_async_checkpointing``),
Megatron-LM's own ``ft_integration``: the monitors watch the sections each rank opens and kill a
rank whose section outlives its timeout. What must hold (``megatron.fault_tolerance``):

* the engine's timeouts, left at their defaults, are lowered below the monitor's at the first
  checkpoint call, and a flush that never ends fails in the engine's own error, naming the
  checkpoint, before the monitor's kill (which would say only that a timeout elapsed);
* each save call runs inside a ``checkpointing`` section, as Megatron-LM's own save does;
* ``--run-slow``: under the monitors the run trains and resumes bit for bit as without them, and
  with ``--calc-ft-timeouts`` FT never derives a ``checkpointing`` timeout from our save calls
  while the lazy wait follows the step timeout it derives.

How late the monitors hear from a rank with a checkpoint every iteration, against none, is
``megatron-ext bench ft-heartbeats`` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from helpers.megatron_lm_runs import DATASTATES, assert_same_trajectory, read_tracker, run, trajectory
from helpers.procs import child_env, python_command
from megatron_ext.engine.faults import STOP_DIR_ENV, STOP_ENV
from megatron_ext.testing import megatron_lm

NPROC = 2
COMMON = ["--bf16", "--use-distributed-optimizer", "--save-interval", "1"]
FT = ["--enable-ft-package", "--ft-num-warmup-iters", "1"]
#: Short timeouts, checked every second: a kill by the monitor would come 12 s into a stuck section.
TIGHT = ["--ft-rank-section-timeouts", "setup:120,step:12,checkpointing:12", "--ft-rank-out-of-section-timeout", "12",
         "--ft-workload-check-interval", "1"]
MONITOR_KILL = "FT timeout elapsed"


@pytest.fixture(autouse=True)
def _nvrx():
    missing = megatron_lm.nvrx_missing()
    if missing:
        pytest.skip(missing)


def _levels(where: Path) -> list[str]:
    return ["--save", str(where / "ckpt"), "--load", str(where / "ckpt"), *DATASTATES]


def _messages(record: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{record}.{rank}").read_text().splitlines()]


def _verify(directory: Path) -> None:
    done = subprocess.run(python_command("-m", "megatron_ext", "verify", str(directory)), capture_output=True,
                          text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_stuck_flush_fails_in_the_engines_error_before_the_rank_monitor_kills(checkout, tmp_path):
    """Every process's second flush stops mid-file for good; training goes on (the host cache has
    room) and the end of training waits for the commit inside the ``checkpointing`` section."""
    stops = tmp_path / "stops"
    stops.mkdir()
    env = {STOP_ENV: "mid_flush@2", STOP_DIR_ENV: str(stops)}
    try:
        result = run(checkout, NPROC, [*COMMON, *FT, "--train-iters", "4", *_levels(tmp_path)], tmp_path, "stuck",
                     ft_launcher=TIGHT, record_ft=tmp_path / "ft.jsonl", env=env, expect_failure=True)
    finally:
        _kill_stopped(stops)
    log = result.log
    assert ("[datastates] fault tolerance: --datastates-snapshot-timeout-s 9.6, --datastates-persist-timeout-s 9.6 "
            "(80% of the rank monitor's timeouts") in log, log[-3000:]
    assert log.count("CheckpointError: commit of iter_0000002 did not finish in time") == NPROC, log[-4000:]
    assert MONITOR_KILL not in log, log[-4000:]
    assert read_tracker(tmp_path / "ckpt") == "1"
    _verify(tmp_path / "ckpt")
    for rank in range(NPROC):
        sections = [(m["section"], m["action"]) for m in _messages(tmp_path / "ft.jsonl", rank)]
        # Per iteration: the step, its save call and the next iteration's finalize, each a section of
        # its own; the end's wait is the checkpointing section the engine's error left open.
        saves = [i for i, s in enumerate(sections) if s == ("step", "close")]
        for i in saves:
            assert sections[i + 1: i + 3] == [("checkpointing", "open"), ("checkpointing", "close")], sections
        assert sections[-1] == ("checkpointing", "open"), sections


def _kill_stopped(stops: Path) -> None:
    """The processes still waiting at the stop point (each marker names its pid): the ranks that
    failed left their I/O workers there."""
    import psutil

    for marker in stops.iterdir():
        with contextlib.suppress(ValueError, psutil.Error):
            psutil.Process(int(marker.suffix.lstrip("."))).kill()


@pytest.mark.slow
def test_under_the_rank_monitors_training_saves_and_resumes_as_without_them(checkout, tmp_path):
    ft = ["--ft-rank-section-timeouts", "setup:600,step:180,checkpointing:420", "--ft-rank-out-of-section-timeout",
          "300"]
    plain = trajectory(run(checkout, NPROC, [*COMMON, "--train-iters", "6", *_levels(tmp_path / "plain")],
                           tmp_path / "plain", "plain"))
    first = run(checkout, NPROC, [*COMMON, *FT, "--train-iters", "6", "--exit-interval", "3",
                                  *_levels(tmp_path / "ft")], tmp_path / "ft", "first", ft_launcher=ft)
    assert "--datastates-snapshot-timeout-s 144, --datastates-persist-timeout-s 336" in first.log
    assert read_tracker(tmp_path / "ft" / "ckpt") == "3"
    resumed = run(checkout, NPROC, [*COMMON, *FT, "--train-iters", "6", *_levels(tmp_path / "ft")], tmp_path / "ft",
                  "resumed", ft_launcher=ft)
    steps = {**trajectory(first), **trajectory(resumed)}
    assert_same_trajectory(dict(sorted(steps.items())), plain, "under ft_launcher vs torchrun")
    assert MONITOR_KILL not in first.log + resumed.log
    _verify(tmp_path / "ft" / "ckpt")


@pytest.mark.slow
def test_calculated_timeouts_leave_checkpointing_alone_and_shorten_the_lazy_wait(checkout, tmp_path):
    """``--calc-ft-timeouts``: FT derives the step timeout from the steps it saw (after 16), never the
    checkpointing one from our millisecond save calls (they count as asynchronous saves, whose
    flush at the end would outlive such a timeout); the lazy wait follows the new step timeout."""
    ft = ["--ft-rank-section-timeouts", "setup:600,step:180,checkpointing:420", "--ft-rank-out-of-section-timeout",
          "300"]
    result = run(checkout, NPROC, [*COMMON, *FT, "--calc-ft-timeouts", "--train-iters", "20", *_levels(tmp_path)],
                 tmp_path, "calc", ft_launcher=ft)
    log = result.log
    assert "FT: can't update the checkpointing section timeout with async checkpointing" in log, log[-3000:]
    assert "calculated_sections={'step'}" in log and "checkpointing=420.00" in log, log[-3000:]
    assert "timeout is now shorter than --datastates-snapshot-timeout-s 144: this wait ends after" in log, log[-3000:]
    assert read_tracker(tmp_path / "ckpt") == "20"
