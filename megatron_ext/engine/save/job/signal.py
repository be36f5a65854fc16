"""``CommitSignal``: how the committer is told that something it waits for changed.

A file became durable on the shared level (the writer or stager, which see it as their next
stage), a commit was requested, a checkpoint was skipped or a background failure happened: each
calls ``notify``. The committer waits on it instead of re-scanning its pending list on a clock.
Built before every stage, so none of them needs the committer itself.
"""

from __future__ import annotations

import threading

from .jobs import FileJob
from .messages import Discard


class CommitSignal:
    """A change counter and a condition: ``wait(seen, timeout)`` returns once ``notify`` ran after ``seen``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._changes = 0

    def notify(self) -> None:
        with self._cond:
            self._changes += 1
            self._cond.notify_all()

    def seen(self) -> int:
        """The change count now: take it before looking, so a change made meanwhile is not missed."""
        with self._cond:
            return self._changes

    def wait(self, seen: int, timeout: float) -> bool:
        """Block until a change after ``seen``, at most ``timeout`` seconds; False if none came."""
        with self._cond:
            return self._cond.wait_for(lambda: self._changes != seen, timeout)

    # The last flush stage hands its results here, as it would to another stage.
    def durable(self, fjob: FileJob) -> None:
        """``fjob`` is durable on the shared level: its checkpoint may be ready to commit."""
        self.notify()

    def discard(self, item: Discard) -> None:
        """A skipped checkpoint's files are removed upstream; the committer settles the job itself."""
        self.notify()


__all__ = ["CommitSignal"]
