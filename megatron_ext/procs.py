"""Starting torchrun jobs on this machine: what the main job, benchmarks and tests share."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """``python -m torch.distributed.run`` on one node with ``nproc`` processes running ``target``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target]


def start_logged(cmd: list[str], env: dict, log_path: str) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, stdout and stderr to ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGKILL ``proc`` and every process below it at once, as a node failure would, and reap ``proc``.

    Not the process group alone: torchrun starts each rank in a session of its own, so its ranks
    would outlive it (and go on training and checkpointing).
    """
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout_s)
    psutil.wait_procs(tree, timeout=timeout_s)


def run_logged(cmd: list[str], env: dict, log_path: str, timeout_s: float) -> int:
    """Run ``cmd`` to completion (output to ``log_path``); whatever it leaves behind is killed.

    A timeout kills the whole session, says so in the log and returns -9.
    """
    proc = start_logged(cmd, env, log_path)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with open(log_path, "a") as log:
            log.write(f"\n[megatron_ext] timed out after {timeout_s:.0f}s: killing the job\n")
        return -9
    finally:
        kill_tree(proc)
