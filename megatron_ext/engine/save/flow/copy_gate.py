"""Copies that wait until the caller says the saved tensors hold their final values.

Some frameworks return from the step with part of a tensor still to be filled by a collective
that the next forward pass waits for (Megatron-LM's ``--overlap-param-gather``: each data-parallel
rank updates its own shard of the parameters; the others arrive by an all-gather). Forcing that
collective before the save blocks the training thread; instead the save is recorded at once and
its copies start when the gate opens, which the framework does where it knows the values are in
place. On a CUDA device the copies are ordered after the work queued on the current stream at
``open()``, so an all-gather that stream waits for comes first.

A wait on the training thread that finds a gate still shut (the lazy wait before the optimizer
step, the end of training) calls ``settle`` there first: the framework's way to make the values
final right away (a blocking all-gather). At an end without a wait (``finish``: an exception, the
interpreter's exit) the gate opens if ``ready`` says the values are final already (no collective
needed); else it settles only where every rank ends the same way (a normal interpreter exit),
and otherwise fails the copy (``cancel``): a collective there could meet a peer doing something
else, or none.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ...errors import CheckpointError

log = logging.getLogger("megatron_ext.engine")


class CopyGate:
    """One save's copies, held until ``open``; single use."""

    def __init__(self, settle: Callable[[], None], what: str = "the saved tensors",
                 ready: Callable[[], bool] | None = None):
        self.settle = settle  # run on the training thread by a wait that finds the gate shut
        self.what = what  # for messages: what the gate waits for
        self.ready = ready  # the values are final already, without running anything (None: never known)
        self.cancelled = False
        self.cancel_reason = "abnormal end"
        self._opened = threading.Event()
        self._on_open: Callable[[], None] = lambda: None
        self._bound = False

    def bind(self, on_open: Callable[[], None]) -> None:
        """The engine's save: what to do on the opening thread when the gate opens (mark its stream)."""
        if self._bound:
            raise CheckpointError("a CopyGate holds the copies of one save only")
        self._on_open, self._bound = on_open, True

    def open(self) -> None:
        """The tensors hold their final values (in stream order, on a device): copy them."""
        if not self._opened.is_set():
            self._on_open()
            self._opened.set()

    def settle_and_open(self) -> None:
        """A wait reached the gate before the framework opened it: make the values final now."""
        if not self._opened.is_set():
            self.settle()
            self.open()

    def cancel(self, reason: str = "abnormal end") -> None:
        """Never copy: the snapshot of this save fails (an abnormal end, where no collective may run)."""
        if not self._opened.is_set():
            self.cancelled, self.cancel_reason = True, reason
            self._opened.set()

    def finish(self, collectives_ok: bool) -> str:
        """At an end no wait reached (training thread): open if the values are final, settle them
        if ``collectives_ok`` (every rank ends here alike), else cancel; returns what was done."""
        if self._opened.is_set():
            return "open"
        if self.ready is not None and self.ready():
            self.open()
            return "ready"
        if not collectives_ok:
            self.cancel("abnormal end: the process ended on an exception, where no collective may run")
            return "cancelled"
        try:
            self.settle()
        except Exception as exc:  # a peer gone, the process group destroyed: the copy fails, loudly
            log.error("[datastates] settling %s at the end failed: %s: %s", self.what, type(exc).__name__, exc)
            self.cancel(f"settling them at the end failed: {type(exc).__name__}: {exc}")
            return "cancelled"
        self.open()
        return "settled"

    def wait(self, deadline_s: float, check: Callable[[], None], poll_s: float = 0.05) -> None:
        """Snapshot thread: block until opened; ``check`` raises on a background failure."""
        while not self._opened.wait(min(poll_s, max(0.0, deadline_s - time.monotonic()))):
            check()
            if time.monotonic() >= deadline_s:
                raise CheckpointError(f"copies waited too long for {self.what} (the gate was never opened)")
        if self.cancelled:
            raise CheckpointError(f"copies cancelled before {self.what} were final ({self.cancel_reason})")
