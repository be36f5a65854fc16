"""The engine's threads as the OS shows them: each under a name of its own.

Python before 3.14 leaves every thread it starts with the process's name, so ``top -H``, ``ps -L``,
``perf``, py-spy and ``/proc/<pid>/task/<tid>/comm`` cannot tell the snapshot copy, the checksums,
the writes and the commit apart from the training thread. Each engine thread names itself as it
starts: ``datastates-snapshot`` shows as ``ds-snapshot`` (Linux keeps 15 bytes), and ``bench
train`` counts the CPU of the threads so named as the engine's. The engine's own count, for its
telemetry (``CpuMeter``), reads the threads it named and its I/O worker process from ``/proc``.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

#: What every engine thread's OS name starts with.
OS_PREFIX = "ds-"
_LINUX_NAME_BYTES = 15
#: Native ids of the live threads ``name_os_thread`` named: what ``CpuMeter`` reads.
_NAMED_TIDS: set[int] = set()


def os_thread_name(name: str) -> str:
    """The OS name of the engine thread called ``name`` (``datastates-io-0`` -> ``ds-io-0``)."""
    return (OS_PREFIX + name.removeprefix("datastates-"))[:_LINUX_NAME_BYTES]


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its OS name (``os_thread_name`` of ``name``, default its Python name);
    on Linux only, and nothing where ``/proc`` refuses it."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(os_thread_name(name if name is not None else threading.current_thread().name))
    except OSError:
        return
    _NAMED_TIDS.add(tid)


class EngineThread(threading.Thread):
    """A daemon thread of the engine, named in the OS before it runs its target."""

    def __init__(self, target, name: str, args: tuple = ()):
        super().__init__(target=target, name=name, args=args, daemon=True)

    def run(self) -> None:
        name_os_thread(self.name)
        try:
            super().run()
        finally:
            _NAMED_TIDS.discard(threading.get_native_id())  # the OS may give its id to another thread


def proc_cpu_seconds(stat_path: str) -> float:
    """User + system CPU seconds in a ``/proc/<pid>[/task/<tid>]/stat`` file; 0 if it is gone (ended)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def thread_cpu_seconds(named: Callable[[str], bool], skip: int | None = None) -> float:
    """CPU seconds of this process's live threads whose OS name (``/proc/self/task/<tid>/comm``)
    ``named`` accepts, thread ``skip`` (a native id) left out; 0 without ``/proc``."""
    if not os.path.isdir("/proc/self/task"):
        return 0.0
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        if skip is not None and int(tid) == skip:
            continue
        name = _os_name(tid)
        if name and named(name):
            total += proc_cpu_seconds(f"/proc/self/task/{tid}/stat")
    return total


class CpuMeter:
    """The CPU seconds (user + system) the engine used since the last reading: its threads in this
    process (the ones it named, and those they started, such as a copy's OpenMP threads, which
    inherit the name) and its I/O worker process (all of its threads).

    Each reading lists this process's threads once and reads the name of a thread only the first
    time it is seen, then one small ``/proc`` file per engine thread: not a read per thread of the
    trainer (it has dozens). Counters move in clock ticks (10 ms), so one reading is coarse and their
    sum over a run is not. A thread that ended takes its last count with it: only what each live one
    added since the last reading is summed.
    """

    def __init__(self):
        self._seen: dict[str, float] = {}
        self._engine: dict[str, bool] = {}  # thread id -> whether the engine's, as first seen

    @staticmethod
    def available() -> bool:
        return os.path.isdir("/proc/self/task")

    def _engine_threads(self) -> list[str]:
        try:
            live = os.listdir("/proc/self/task")
        except OSError:
            return []
        engine = {}
        for tid in live:
            known = self._engine.get(tid)
            engine[tid] = known if known is not None else (int(tid) in _NAMED_TIDS or _os_name(tid).startswith(OS_PREFIX))
        self._engine = engine
        return [tid for tid, mine in engine.items() if mine or int(tid) in _NAMED_TIDS]

    def since_last(self, worker_pid: int | None = None) -> float:
        paths = [f"/proc/self/task/{tid}/stat" for tid in self._engine_threads()]
        if worker_pid is not None:
            paths.append(f"/proc/{worker_pid}/stat")
        used, seen = 0.0, {}
        for path in paths:
            now = proc_cpu_seconds(path)
            used += max(0.0, now - self._seen.get(path, 0.0))
            seen[path] = now
        self._seen = seen
        return used


def _os_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # it ended meanwhile
        return ""


__all__ = ["CpuMeter", "EngineThread", "OS_PREFIX", "name_os_thread", "os_thread_name", "proc_cpu_seconds",
           "thread_cpu_seconds"]
