"""Child processes of the tests: where the repository is, the environment children get, and the
one way to start torchrun (``megatron_ext.procs.torchrun_command``, what the main job and the
benchmarks use too) with its free rendezvous port, through the session's warm ranks
(``helpers.warm_ranks``) when they run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from megatron_ext.procs import free_port
from megatron_ext.procs import torchrun_command as cold_torchrun_command

from helpers import warm_ranks

__all__ = ["REPO", "TESTS", "alive", "child_env", "free_port", "job_ranks", "job_tree", "run_worker",
           "python_command", "torchrun_command", "wait_until", "warm_command"]

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """torchrun on one node with ``nproc`` ranks running ``target``, warm when the session's zygote runs."""
    return warm_command(cold_torchrun_command(nproc, *target))


def python_command(*args: str) -> list[str]:
    """``python ARGS`` (``-m megatron_ext convert ...``), forked from the session's zygote when one runs:
    for the command line tools the tests call, whose imports (torch, megatron-core) cost more than
    their work. Not for a command whose process tree is measured (``process_watch``)."""
    if os.environ.get(warm_ranks.ENV):
        return [sys.executable, warm_ranks.__file__, "run", *args]
    return [sys.executable, *args]


def warm_command(cmd: list[str]) -> list[str]:
    """A torchrun command line (``megatron_ext.procs.torchrun_command``'s) through ``helpers.warm_ranks``
    when this session has a zygote; the launcher itself falls back to torchrun for what it cannot serve."""
    if os.environ.get(warm_ranks.ENV) and cmd[1:3] == ["-m", "torch.distributed.run"]:
        return [cmd[0], warm_ranks.__file__, "launch", *cmd[3:]]
    return cmd


def job_ranks(pid: int) -> list:
    """The rank processes (``psutil.Process``es, in rank order) of the torchrun job launched as ``pid``:
    the zygote's forks for a warm job, torchrun's children for a cold one."""
    import psutil

    warm = warm_ranks.job_ranks(pid)
    return [psutil.Process(p) for p in warm] if warm else psutil.Process(pid).children()


def job_tree(pid: int) -> list:
    """Every process of the torchrun job launched as ``pid`` (``psutil.Process``es, ``pid`` itself not
    among them): its descendants, and for a warm job its ranks, which the session's zygote forked,
    and theirs. What a test SIGKILLs to crash a whole job at once, as a node failure would."""
    import psutil

    tree = psutil.Process(pid).children(recursive=True)
    for rank in warm_ranks.job_ranks(pid):
        try:
            process = psutil.Process(rank)
            tree += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return tree


def kill_job(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL a whole torchrun job launched as ``proc`` at once, as a node failure would: its ranks
    first (``job_tree``: torchrun starts them in sessions of their own, a warm job's are not even its
    children), then the launcher; returns once all of them are gone. A launcher that ended already
    took its ranks with it."""
    import psutil

    tree = job_tree(proc.pid) if proc.poll() is None else []
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=timeout)
    psutil.wait_procs(tree, timeout=timeout)


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
