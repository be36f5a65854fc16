"""A daemon thread that handles queued items one by one, in order: the shape of every stage."""

from __future__ import annotations

import queue
import threading
from typing import Any

_STOP = object()


class QueueWorker:
    """Subclasses implement ``handle``; they call ``start`` at the end of their ``__init__``."""

    def start(self, name: str) -> None:
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> None:
        self._queue.put(item)

    def stop(self, timeout: float) -> None:
        """Finish what is queued, then end the thread (waiting at most ``timeout`` seconds)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def handle(self, item: Any) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self.handle(item)
