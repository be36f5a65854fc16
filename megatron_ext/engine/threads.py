"""The engine's threads as the OS shows them: each under a name of its own.

Python before 3.14 leaves every thread it starts with the process's name, so ``top -H``, ``ps -L``,
``perf``, py-spy and ``/proc/<pid>/task/<tid>/comm`` cannot tell the snapshot copy, the checksums,
the writes and the commit apart from the training thread. Each engine thread names itself as it
starts: ``datastates-snapshot`` shows as ``ds-snapshot`` (Linux keeps 15 bytes), and ``bench
train`` counts the CPU of the threads so named as the engine's.
"""

from __future__ import annotations

import sys
import threading

#: What every engine thread's OS name starts with.
OS_PREFIX = "ds-"
_LINUX_NAME_BYTES = 15


def os_thread_name(name: str) -> str:
    """The OS name of the engine thread called ``name`` (``datastates-io-0`` -> ``ds-io-0``)."""
    return (OS_PREFIX + name.removeprefix("datastates-"))[:_LINUX_NAME_BYTES]


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its OS name (``os_thread_name`` of ``name``, default its Python name);
    on Linux only, and nothing where ``/proc`` refuses it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(os_thread_name(name if name is not None else threading.current_thread().name))
    except OSError:
        pass


class EngineThread(threading.Thread):
    """A daemon thread of the engine, named in the OS before it runs its target."""

    def __init__(self, target, name: str, args: tuple = ()):
        super().__init__(target=target, name=name, args=args, daemon=True)

    def run(self) -> None:
        name_os_thread(self.name)
        super().run()


__all__ = ["EngineThread", "OS_PREFIX", "name_os_thread", "os_thread_name"]
