"""Fault-injection hook for tests: armed callables run before every storage write.

Production code pays one empty-list check per chunk. Tests arm a hook to raise ``OSError``
(no space, I/O error), sleep (a slow file system) or kill the process at a chosen moment.
"""

from __future__ import annotations

import threading
from typing import Callable

WriteHook = Callable[[str, str, int, int], None]  # (level, path, offset, nbytes)

_hooks: list[WriteHook] = []
_lock = threading.Lock()


def arm(hook: WriteHook) -> None:
    with _lock:
        _hooks.append(hook)


def disarm_all() -> None:
    with _lock:
        _hooks.clear()


def before_write(level: str, path: str, offset: int, nbytes: int) -> None:
    if _hooks:
        for hook in list(_hooks):
            hook(level, path, offset, nbytes)
