"""A daemon thread that handles queued items one by one, in order: the shape of every stage."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

_STOP = object()


class QueueWorker:
    """Subclasses implement ``handle``; they call ``start`` at the end of their ``__init__``."""

    def start(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        """``on_start`` runs first on the new thread (e.g. binding it to the rank's CUDA device)."""
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._on_start = on_start
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
        if self._on_start is not None:
            self._on_start()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            self.handle(item)
