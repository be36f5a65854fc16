"""Fault-injection hooks for tests: armed callables run before every storage write, and a hold on copies.

Production code pays one empty-list check per chunk and one flag check per save. Tests arm a
hook to raise ``OSError`` (no space, I/O error), sleep (a slow file system) or kill the process at
a chosen moment, and ``hold_copies_until_wait`` makes every snapshot copy as late as the lazy
contract allows (when the training thread calls ``wait_snapshot``), so a tensor the trainer
changes before its optimizer step is caught every time instead of by a lucky race; the hold is a
``CopyGate`` per save (``held``), the same gate a framework's collective holds copies with.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .save.flow.copy_gate import CopyGate

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


_holding = False


def hold_copies_until_wait() -> None:
    """From now on a file's copies start only once the training thread waits for them (``held``)."""
    global _holding
    _holding = True


def held(gate: "CopyGate | None") -> "CopyGate | None":
    """The gate a new save's copies wait behind: ``gate`` itself, or with ``hold_copies_until_wait``
    one that only the training thread's next wait opens (``wait_snapshot`` settles every gate still
    shut), settling ``gate`` first if the caller passed one. The engine's one copy gate serves both."""
    if not _holding:
        return gate
    from .save.flow.copy_gate import CopyGate

    if gate is None:
        return CopyGate(settle=lambda: None, what="the copies held until the wait (faults.hold_copies_until_wait)",
                        ready=lambda: True)
    return CopyGate(settle=gate.settle_and_open, what=gate.what, ready=gate.ready)
