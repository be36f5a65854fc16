"""Launching the reference trainer under torchrun for the Megatron tests (CPU ranks, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_ext.procs import free_port, torchrun_command  # noqa: F401  (free_port: re-exported)

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300

# Small but real: bf16, distributed optimizer, 2 micro-batches per DP rank per iteration.
COMMON = ["--bf16", "--use-distributed-optimizer", "--global-batch-size", "8",
          "--micro-batch-size", "2", "--seed", "1234"]


def run_trainer(nproc: int, args: list[str], log_json: Path, expect_crash: bool = False,
                common: list[str] = COMMON) -> list[dict]:
    """Run the trainer on ``nproc`` CPU processes; return the JSON lines it logged.

    With ``expect_crash`` the run must end in failure (the trainer SIGKILLs itself). ``common``
    replaces the shared defaults (e.g. to train in fp32).
    """
    cmd = torchrun_command(nproc, "-m", "megatron_ext.testing.reference_trainer", *common, *args,
                           "--log-json", str(log_json))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if (proc.returncode != 0) != expect_crash:
        pytest.fail(f"trainer exit code {proc.returncode} (expected {'failure' if expect_crash else 0}): "
                    f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    if not log_json.exists():
        return []
    return [json.loads(line) for line in log_json.read_text().splitlines()]
