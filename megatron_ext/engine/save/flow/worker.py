"""A daemon thread that handles queued items one by one, in order: the shape of every stage."""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from ...threads import EngineThread

_STOP = object()


class WorkQueue:
    """A stage's inbox: first in, first out, with ``cancel`` to take queued items back (a skipped
    checkpoint's chunks) under the queue's own lock, never another class's internals."""

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, item: Any) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def get(self) -> Any:
        """The oldest item, waiting for one (a stage's thread has nothing else to do meanwhile)."""
        with self._ready:
            while not self._items:
                self._ready.wait()
            return self._items.popleft()

    def cancel(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """Take every queued item ``predicate`` accepts out of the queue; returns them, in order."""
        with self._ready:
            taken = [item for item in self._items if predicate(item)]
            if taken:
                kept = [item for item in self._items if not predicate(item)]
                self._items.clear()
                self._items.extend(kept)
            return taken

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)


class QueueWorker:
    """Subclasses implement ``handle``; they call ``start`` at the end of their ``__init__``."""

    def start(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        """``on_start`` runs first on the new thread (e.g. binding it to the rank's CUDA device)."""
        self._queue = WorkQueue()
        self._on_start = on_start
        self._thread = EngineThread(self._loop, name)
        self._thread.start()

    def submit(self, item: Any) -> None:
        self._queue.put(item)

    def cancel(self, predicate: Callable[[Any], bool]) -> list[Any]:
        """Take queued items ``predicate`` accepts back before this thread handles them (``WorkQueue.cancel``)."""
        return self._queue.cancel(predicate)

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
