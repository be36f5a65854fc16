"""Telemetry: one JSON line per checkpoint and level, and one short human line in the log.

A telemetry file that cannot be written is logged, never a checkpoint failure: the engine probes
its directory at start-up, and a disk that fills later must not cost the checkpoint itself.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time

log = logging.getLogger("megatron_ext.engine")


class Telemetry:
    def __init__(self, path: str | None, rank: int):
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self.records: collections.deque[dict] = collections.deque(maxlen=10_000)  # the latest, for benchmarks and tests
        self.write_errors = 0  # records that could not be written to ``path``
        self._reported: set[int | None] = set()
        self._batches = threading.local()  # per thread: lines held by ``batch()`` (None: write at once)

    @contextlib.contextmanager
    def batch(self):
        """Records emitted on this thread inside the block are written in one ``write`` at its end
        (also when it raises): a commit's three records cost one system call, not three."""
        if getattr(self._batches, "lines", None) is not None:  # nested: the outer block writes them
            yield
            return
        self._batches.lines = []
        try:
            yield
        finally:
            lines, self._batches.lines = self._batches.lines, None
            if lines:
                with self._lock:
                    self._write(b"".join(lines))

    def _append(self, data: bytes) -> None:
        """``data`` appended in three system calls (open, write, close), reopened each time so a
        rotated or removed file is written anew; the records of one commit come as one ``data``
        (``batch``): each system call on a background thread is a GIL switch for the training thread."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:  # its directory was removed: make it again
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd = os.open(self.path, flags, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def _write(self, data: bytes) -> None:
        """Under the lock: ``data`` appended; a failure is counted and logged, never raised."""
        if not data:
            return
        try:
            self._append(data)
        except OSError as exc:  # telemetry never costs a checkpoint; say so once per kind of failure
            self.write_errors += data.count(b"\n")
            if exc.errno not in self._reported:
                self._reported.add(exc.errno)
                log.warning("[datastates] rank %d cannot write telemetry to %s: %s (checkpoints go on; "
                            "further failures like this one are counted, not logged)",
                            self.rank, self.path, exc.strerror or exc)

    def emit(self, event: str, checkpoint: str, level: str, nbytes: int, seconds: float | None = None,
             **extra) -> dict:
        record = {
            "time": round(time.time(), 6),
            "event": event,
            "rank": self.rank,
            "checkpoint": checkpoint,
            "level": level,
            "bytes": nbytes,
        }
        if seconds is not None:
            record["seconds"] = round(seconds, 6)
            record["gbps"] = round(nbytes / seconds / 1e9, 4) if seconds > 0 else None
        record.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in extra.items()})
        line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8") if self.path else b""
        held = getattr(self._batches, "lines", None)
        with self._lock:
            self.records.append(record)
            if held is not None:
                held.append(line)
            elif line:
                self._write(line)
        rate = f", {record['gbps']:.2f} GB/s" if record.get("gbps") else ""
        took = f" in {seconds:.3f}s" if seconds is not None else ""
        cpu = ""
        if extra.get("cpu_s_per_gb") is not None:
            cpu = f", engine CPU {extra['cpu_s']:.3f}s ({extra['cpu_s_per_gb']:.3f} s/GB)"
        log.info("[datastates] rank %d %s %s %s: %.1f MB%s%s%s%s", self.rank, checkpoint, event, level,
                 nbytes / 1e6, took, rate,
                 f", training blocked {extra['blocked_s']:.4f}s" if "blocked_s" in extra else "", cpu)
        return record
