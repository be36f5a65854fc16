"""Fault-injection hooks for tests: armed callables run before every storage write, and a copy gate.

Production code pays one empty-list check per chunk and one ``None`` check per file. Tests arm a
hook to raise ``OSError`` (no space, I/O error), sleep (a slow file system) or kill the process at
a chosen moment, and ``hold_copies_until_wait`` makes every snapshot copy as late as the lazy
contract allows (when the training thread calls ``wait_snapshot``), so a tensor the trainer
changes before its optimizer step is caught every time instead of by a lucky race.
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


_copy_gate: threading.Event | None = None
GATE_TIMEOUT_S = 300.0  # a gate is never a hang: copies go ahead after this long


def hold_copies_until_wait() -> None:
    """From now on a file's copies start only once the training thread calls ``wait_snapshot``."""
    global _copy_gate
    _copy_gate = threading.Event()


def release_copies() -> None:
    global _copy_gate
    gate, _copy_gate = _copy_gate, None
    if gate is not None:
        gate.set()


def saved() -> None:
    """The engine recorded a save: its copies wait for the next ``waiting()``."""
    if _copy_gate is not None:
        _copy_gate.clear()


def waiting() -> None:
    """The training thread waits for the snapshots: the copies may run."""
    if _copy_gate is not None:
        _copy_gate.set()


def before_copy() -> None:
    """The snapshot thread is about to copy a file."""
    gate = _copy_gate
    if gate is not None:
        gate.wait(GATE_TIMEOUT_S)
