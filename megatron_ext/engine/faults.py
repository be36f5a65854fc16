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


# ------------------------------------------------------------------------ named stop points
#: ``MEGATRON_EXT_TEST_STOP=<point>@<n>`` with ``MEGATRON_EXT_TEST_STOP_DIR=<directory>``: the n-th time
#: this process reaches ``<point>`` it writes ``<directory>/<point>.<pid>`` and waits there to be killed,
#: so a test can SIGKILL a whole job at one exact moment of a save (tests/megatron_lm/test_kill_matrix.py).
#: Read once, at import: the I/O worker inherits them through its environment.
STOP_ENV, STOP_DIR_ENV = "MEGATRON_EXT_TEST_STOP", "MEGATRON_EXT_TEST_STOP_DIR"
#: The moments of a save a stop can be armed at, in the order a checkpoint passes them.
STOP_POINTS = (
    "after_save",  # the training thread: save() recorded the file and returns
    "mid_copy",  # the snapshot thread: a file's first run copied into the host cache, the rest not
    "mid_flush",  # the writer: a file's first run written, the file not yet durable
    "mid_stage",  # node-local to shared: a tensor file copied, its sidecar not
    "after_report",  # the committer: this rank's report durable, its status not posted
    "before_rename:manifest.json",  # rank 0: the manifest's temporary file durable, not yet renamed
    "before_tracker",  # the manifest committed, the on_committed callbacks (Megatron-LM's tracker) not run
    "mid_retention",  # an old checkpoint renamed out of sight, not yet deleted
)
STOP_WAIT_S = 300.0  # then the process exits on its own: a test that forgot to kill it does not hang


def _armed_stop() -> tuple[str, int, str] | None:
    spec = os.environ.get(STOP_ENV)
    if not spec:
        return None
    point, _, count = spec.rpartition("@")
    directory = os.environ.get(STOP_DIR_ENV, "")
    if point not in STOP_POINTS or not count.isdigit() or int(count) < 1 or not os.path.isdir(directory):
        raise ValueError(f"{STOP_ENV}={spec!r}, {STOP_DIR_ENV}={directory!r}: expected <point>@<n> with <point> "
                         f"one of {STOP_POINTS} and an existing directory")
    return point, int(count), directory


_stop = _armed_stop()
_arrivals: dict[str, int] = {}


def stop_point(point: str) -> None:
    """A named moment of a save (``STOP_POINTS``); unless a test armed it, one comparison."""
    if _stop is None or _stop[0] != point:
        return
    with _lock:
        _arrivals[point] = seen = _arrivals.get(point, 0) + 1
    if seen != _stop[1]:
        return
    marker = os.path.join(_stop[2], f"{point.replace(':', '_')}.{os.getpid()}")
    with open(marker, "w") as f:
        f.write(f"{point}@{seen}\n")
    time.sleep(STOP_WAIT_S)
    os._exit(70)
