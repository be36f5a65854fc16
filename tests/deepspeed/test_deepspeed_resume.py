"""Crash and resume through real DeepSpeed (2 CPU ranks, gloo), with DeepSpeed itself as the oracle.

A run with this project's engine (``datastates_ckpt``) SIGKILLs every rank right after step 3's
``save_checkpoint`` returns, while that checkpoint is still being copied and flushed (before that
save it waits until step 1 or later is committed, so a slow machine still leaves a tag); the restart
resumes from the newest *committed* tag N (the one ``latest`` names) and goes on to step 6. The
oracle is DeepSpeed's own engine (``torch.save``) resumed from the same tag: a run that saves
steps 1..N with it, then a restart that loads tag N and goes on to step 6. Losses and parameter
sums of every rank after N must be equal as ``float.hex()`` strings. (DeepSpeed's resume is the
oracle rather than an uninterrupted run: a resume from an early step is not always identical to
never stopping, e.g. with ZeRO-3, and what this project owes is exactly DeepSpeed's own resume.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers.procs import REPO, child_env, python_command, torchrun_command

RUN_TIMEOUT_S = 240
STEPS, KILL_AT = 6, 3
COMPARED = ("rank_losses", "rank_param_sums")


def run_harness(args: list[str], log_json: Path, expect_crash: bool = False, script: Path | None = None) -> list[dict]:
    """Run ``megatron_ext.testing.deepspeed_harness`` (or ``script``, which wraps it) on 2 CPU ranks; return
    the JSON lines logged so far."""
    entry = [str(script)] if script is not None else ["-m", "megatron_ext.testing.deepspeed_harness"]
    cmd = torchrun_command(2, *entry, *args, "--log-json", str(log_json))
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if (proc.returncode != 0) != expect_crash:
        pytest.fail(f"harness exit code {proc.returncode} (expected {'a crash' if expect_crash else 0}): "
                    f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    if expect_crash:
        assert "SIGKILL" in proc.stdout + proc.stderr, "the run failed, but not by its own SIGKILL"
    if not log_json.exists():
        return []
    return [json.loads(line) for line in log_json.read_text().splitlines()]


def _committed_step(save_dir: Path) -> int:
    return int((save_dir / "latest").read_text().strip().removeprefix("global_step"))


def _assert_latest_is_committed(save_dir: Path) -> None:
    """``latest`` names a tag whose manifest exists and whose files verify."""
    tag = (save_dir / "latest").read_text().strip()
    assert (save_dir / tag / "manifest.json").exists()
    verify = subprocess.run(python_command("-m", "megatron_ext", "verify", str(save_dir), "--checkpoint", tag),
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in ("loss", *COMPARED)} for r in records}


def oracle(tmp_path: Path, common: list[str], resume_from: int) -> dict[int, dict]:
    """DeepSpeed's own engine: save steps 1..resume_from, then resume from that tag to the end."""
    save_dir = tmp_path / "oracle"
    first = by_step(run_harness([*common, "--engine", "torch", "--steps", str(resume_from), "--save-dir", str(save_dir)],
                                tmp_path / "oracle-first.jsonl"))
    assert sorted(first) == list(range(1, resume_from + 1)) and _committed_step(save_dir) == resume_from
    resumed = by_step(run_harness([*common, "--engine", "torch", "--steps", str(STEPS), "--save-dir", str(save_dir),
                                   "--load"], tmp_path / "oracle-resumed.jsonl"))
    assert sorted(resumed) == list(range(resume_from + 1, STEPS + 1))
    return {**first, **resumed}


def crash_and_resume(tmp_path: Path, common: list[str]) -> tuple[int, dict[int, dict], dict[int, dict]]:
    """(committed step resumed from, crashed run's steps, resumed run's steps) with datastates."""
    save_dir = tmp_path / "crash"
    crashed = by_step(run_harness([*common, "--engine", "datastates", "--steps", str(STEPS), "--save-dir", str(save_dir),
                                   "--kill-at-step", str(KILL_AT), "--committed-before-kill", "1"],
                                  tmp_path / "crashed.jsonl", expect_crash=True))
    assert sorted(crashed) == list(range(1, KILL_AT + 1))
    resume_from = _committed_step(save_dir)
    assert 1 <= resume_from <= KILL_AT
    _assert_latest_is_committed(save_dir)
    resumed = by_step(run_harness([*common, "--engine", "datastates", "--steps", str(STEPS), "--save-dir",
                                   str(save_dir), "--load"], tmp_path / "resumed.jsonl"))
    assert sorted(resumed) == list(range(resume_from + 1, STEPS + 1))
    return resume_from, crashed, resumed


@pytest.mark.multiproc
# Plain ZeRO-2 runs with --run-slow: its bf16 + scheduler variant covers stage 2 in the default run.
@pytest.mark.parametrize("common", [["--zero-stage", "1"],
                                    pytest.param(["--zero-stage", "2"], marks=pytest.mark.slow), ["--zero-stage", "3"],
                                    ["--zero-stage", "2", "--dtype", "bf16", "--scheduler"]],
                         ids=["zero1", "zero2", "zero3", "zero2-bf16-scheduler"])
def test_sigkill_after_save_then_resume_matches_deepspeed_own_resume(tmp_path, common):
    resume_from, crashed, resumed = crash_and_resume(tmp_path, common)
    expected = oracle(tmp_path, common, resume_from)
    # Same data and same init: the steps before the crash agree too, so a mismatch later is the checkpoint's fault.
    assert {s: crashed[s] for s in crashed} == {s: expected[s] for s in crashed}
    for step in resumed:
        assert resumed[step] == expected[step], f"step {step} differs from DeepSpeed's own resume from {resume_from}"


@pytest.mark.multiproc
@pytest.mark.slow
def test_pipeline_sigkill_then_resume_matches_deepspeed_own_resume(tmp_path):
    """2-stage PipelineModule (ZeRO-1; pipelines reject ZeRO-2): layer files instead of one model file."""
    common = ["--zero-stage", "1", "--pipeline"]
    resume_from, _, resumed = crash_and_resume(tmp_path, common)
    expected = oracle(tmp_path, common, resume_from)
    for step in resumed:
        assert resumed[step] == expected[step], f"step {step} differs from DeepSpeed's own resume from {resume_from}"
