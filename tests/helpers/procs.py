"""Child processes of the tests: where the repository is, the environment children get, and the
one way to start torchrun (``megatron_ext.procs.torchrun_command``, what the main job and the
benchmarks use too) with its free rendezvous port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_ext.procs import free_port, torchrun_command

__all__ = ["REPO", "TESTS", "child_env", "free_port", "run_worker", "torchrun_command"]

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def child_env(**extra: str) -> dict[str, str]:
    """This environment plus one OpenMP thread, unbuffered output, and the checkout and ``tests/``
    first on ``PYTHONPATH`` (a worker run by path imports ``megatron_ext`` and ``helpers``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(TESTS), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_worker(path: Path, *args: str, timeout: float = 90, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    """Run the worker program ``path`` with ``args`` in a fresh interpreter; check its exit code."""
    return _checked(subprocess.run([sys.executable, str(path), *args], env=child_env(), cwd=str(REPO),
                                   capture_output=True, text=True, timeout=timeout), check_rc)


def _checked(proc: subprocess.CompletedProcess, check_rc: int | None) -> subprocess.CompletedProcess:
    if check_rc is not None:
        assert proc.returncode == check_rc, (
            f"child exited {proc.returncode}, expected {check_rc}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-5000:]}")
    return proc
