"""Crash and resume through real DeepSpeed (2 CPU ranks, gloo): the resumed run must match bit for bit.

An uninterrupted run of 6 steps is the reference. A second run SIGKILLs every rank right after
step 3's ``save_checkpoint`` returns, and a third resumes it with ``load_checkpoint`` and goes on
to step 6. Losses and parameter sums of every rank for steps 4..6 must be equal as
``float.hex()`` strings. ``ENGINES`` is the checkpoint engine parameter: 'torch' is DeepSpeed's
own engine (``torch.save``), 'datastates' is this project's module loaded by DeepSpeed from the
``datastates_ckpt`` config section. With datastates the kill lands while step 3's checkpoint is
still being copied and flushed, so the restart resumes from the newest *committed* tag (the one
``latest`` names), which may be older; the steps after it must match the reference all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.procs import torchrun_command

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240
STEPS, KILL_AT = 6, 3
ENGINES = ["torch", "datastates"]
COMPARED = ("rank_losses", "rank_param_sums")


def run_harness(args: list[str], log_json: Path, expect_crash: bool = False) -> list[dict]:
    """Run ``megatron_ext.deepspeed_harness`` on 2 CPU ranks; return the JSON lines logged so far."""
    cmd = torchrun_command(2, "-m", "megatron_ext.deepspeed_harness", *args, "--log-json", str(log_json))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
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
    verify = subprocess.run([sys.executable, "-m", "megatron_ext", "verify", str(save_dir), "--checkpoint", tag],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in ("loss", *COMPARED)} for r in records}


@pytest.mark.multiproc
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_sigkill_after_save_then_resume_is_bit_exact(tmp_path, engine, zero_stage):
    common = ["--zero-stage", str(zero_stage), "--engine", engine, "--steps", str(STEPS)]

    reference = by_step(run_harness([*common, "--save-dir", str(tmp_path / "ref")], tmp_path / "ref.jsonl"))
    assert sorted(reference) == list(range(1, STEPS + 1))

    save_dir = tmp_path / "crash"
    crashed = by_step(run_harness([*common, "--save-dir", str(save_dir), "--kill-at-step", str(KILL_AT)],
                                  tmp_path / "crashed.jsonl", expect_crash=True))
    assert sorted(crashed) == list(range(1, KILL_AT + 1))
    resume_from = _committed_step(save_dir)
    if engine == "torch":
        assert resume_from == KILL_AT  # torch.save returned only when the bytes were written
    else:
        assert 1 <= resume_from <= KILL_AT
        _assert_latest_is_committed(save_dir)

    resumed = by_step(run_harness([*common, "--save-dir", str(save_dir), "--load"], tmp_path / "resumed.jsonl"))
    assert sorted(resumed) == list(range(resume_from + 1, STEPS + 1))

    # Same data and same init: the first steps agree too, so a mismatch later is the checkpoint's fault.
    assert {s: crashed[s] for s in crashed} == {s: reference[s] for s in crashed}
    for step in resumed:
        assert resumed[step] == reference[step], f"step {step} differs after resume"


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_pipeline_sigkill_then_resume_is_bit_exact(tmp_path, engine):
    """2-stage PipelineModule (ZeRO-1; pipelines reject ZeRO-2): layer files instead of one model file."""
    common = ["--zero-stage", "1", "--pipeline", "--engine", engine, "--steps", str(STEPS)]
    reference = by_step(run_harness([*common, "--save-dir", str(tmp_path / "ref")], tmp_path / "ref.jsonl"))
    save_dir = tmp_path / "crash"
    run_harness([*common, "--save-dir", str(save_dir), "--kill-at-step", str(KILL_AT)],
                tmp_path / "crashed.jsonl", expect_crash=True)
    resume_from = _committed_step(save_dir)
    resumed = by_step(run_harness([*common, "--save-dir", str(save_dir), "--load"], tmp_path / "resumed.jsonl"))
    assert sorted(resumed) == list(range(resume_from + 1, STEPS + 1))
    for step in resumed:
        assert resumed[step] == reference[step], f"step {step} differs after resume"
