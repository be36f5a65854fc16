"""Child processes of the tests: where the repository is, the environment children get, and the
one way to start torchrun (``megatron_ext.procs.torchrun_command``, what the main job and the
benchmarks use too) with its free rendezvous port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from megatron_ext.procs import free_port, torchrun_command

__all__ = ["REPO", "TESTS", "alive", "child_env", "free_port", "run_worker", "torchrun_command", "wait_until"]

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


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (ended, not reaped yet) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # the state follows the command name, which may itself hold spaces or parentheses
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; an ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")
        time.sleep(0.01)
