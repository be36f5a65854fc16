"""Fault-injection hook for tests: armed callables run before every storage write.

Production code pays one empty-list check per chunk. Tests arm a hook to raise ``OSError``
(no space, I/O error), sleep (a slow file system) or kill the process at a chosen moment.
"""

from __future__ import annotations

import os
import threading
import time
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


def throttle(bytes_per_s: float, under: str | None = None) -> WriteHook:
    """A hook for a slow file system: each write (under ``under``, if given) takes nbytes / rate longer."""
    prefix = os.path.abspath(under) if under is not None else None

    def hook(level: str, path: str, offset: int, nbytes: int) -> None:
        if prefix is None or os.path.abspath(path).startswith(prefix):
            time.sleep(nbytes / bytes_per_s)

    return hook


def before_write(level: str, path: str, offset: int, nbytes: int) -> None:
    if _hooks:
        for hook in list(_hooks):
            hook(level, path, offset, nbytes)
