"""A child command run under watch: its peak RSS (``ru_maxrss`` from ``wait4``), and the most
processes and shared-memory segments (memfds) its process tree held at once.

Why a watch and not only the figures at the end: a command that breaks a bound on a machine
shared with others (hundreds of I/O worker processes, tens of GiB of host caches) is killed as
soon as the bound is broken, so the test fails without taking the machine down with it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import tempfile
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class Watched:
    returncode: int
    stdout: str
    stderr: str
    max_rss_bytes: int  # the command's own peak resident set (wait4's ru_maxrss)
    wall_s: float
    peak_processes: int  # the command and its descendants, at most at once
    peak_memfds: int  # memfd shared-memory segments open in the tree, at most at once
    peak_tree_rss_bytes: int  # the tree's summed resident sets, at most (shared pages counted per process)
    killed_for: str | None  # the bound that was broken (then the command was killed), else None


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return found


def _tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _memfds(pid: int) -> set[str]:
    """The memfds ``pid`` has open, by inode (a segment shared by parent and child counts once)."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/memfd:"):
                found.add(f"{os.stat(f'/proc/{pid}/fd/{fd}').st_ino}")
        except OSError:
            pass
    return found


def run_watched(cmd: list[str], *, env: dict, cwd: str, timeout_s: float, max_processes: int | None = None,
                max_memfds: int | None = None, max_tree_rss_bytes: int | None = None,
                poll_s: float = 0.05) -> Watched:
    """Run ``cmd`` in a session of its own; kill that session when a bound or ``timeout_s`` is passed."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
        peak_procs = peak_fds = peak_rss = 0
        killed_for = None
        done = None  # (status, rusage) once reaped
        while done is None:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # reaped here, so its rusage is ours to read
            if pid:
                done = status, usage
                break
            tree = _tree(proc.pid)
            memfds = set().union(*(_memfds(p) for p in tree))
            tree_rss = sum(_rss(p) for p in tree)
            peak_procs, peak_fds = max(peak_procs, len(tree)), max(peak_fds, len(memfds))
            peak_rss = max(peak_rss, tree_rss)
            if max_processes is not None and len(tree) > max_processes:
                killed_for = f"{len(tree)} processes (bound {max_processes})"
            elif max_memfds is not None and len(memfds) > max_memfds:
                killed_for = f"{len(memfds)} shared-memory segments (bound {max_memfds})"
            elif max_tree_rss_bytes is not None and tree_rss > max_tree_rss_bytes:
                killed_for = f"{tree_rss / 2**20:.0f} MiB resident (bound {max_tree_rss_bytes / 2**20:.0f} MiB)"
            elif time.monotonic() - started > timeout_s:
                killed_for = f"still running after {timeout_s:.0f}s"
            if killed_for is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the session this call started, nothing else
                except ProcessLookupError:
                    pass
                break
            time.sleep(poll_s)
        if done is None:
            _, status, usage = os.wait4(proc.pid, 0)
        else:
            status, usage = done
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Watched(proc.returncode, out.read(), err.read(), usage.ru_maxrss * 1024, wall, peak_procs, peak_fds,
                       peak_rss, killed_for)


__all__ = ["Watched", "run_watched"]
