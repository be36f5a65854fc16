"""Launching the reference trainer (``megatron_ext.testing.reference_trainer``) under torchrun for
the tests (CPU ranks, gloo)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers.procs import REPO, child_env, torchrun_command

RUN_TIMEOUT_S = 300

# Small but real: bf16, distributed optimizer, 2 micro-batches per DP rank per iteration.
COMMON = ["--bf16", "--use-distributed-optimizer", "--global-batch-size", "8",
          "--micro-batch-size", "2", "--seed", "1234"]


def trainer_command(nproc: int, *args: str) -> list[str]:
    """The torchrun command line running the reference trainer with ``args`` on ``nproc`` ranks."""
    return torchrun_command(nproc, "-m", "megatron_ext.testing.reference_trainer", *args)


def trainer_env(**extra: str) -> dict[str, str]:
    """The trainer's environment: ``child_env`` with no GPU visible (the CPU emulation, gloo)."""
    return child_env(CUDA_VISIBLE_DEVICES="", **extra)


def run_trainer(nproc: int, args: list[str], log_json: Path, expect_crash: bool = False,
                common: list[str] = COMMON) -> list[dict]:
    """Run the trainer on ``nproc`` CPU processes; return the JSON lines it logged.

    With ``expect_crash`` the run must end in failure (the trainer SIGKILLs itself). ``common``
    replaces the shared defaults (e.g. to train in fp32).
    """
    cmd = trainer_command(nproc, *common, *args, "--log-json", str(log_json))
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if (proc.returncode != 0) != expect_crash:
        pytest.fail(f"trainer exit code {proc.returncode} (expected {'failure' if expect_crash else 0}): "
                    f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    if not log_json.exists():
        return []
    return [json.loads(line) for line in log_json.read_text().splitlines()]
