"""Telemetry: one JSON line per checkpoint and level, and one short human line in the log.

A telemetry file that cannot be written is logged, never a checkpoint failure: the engine probes
its directory at start-up, and a disk that fills later must not cost the checkpoint itself.
"""

from __future__ import annotations

import collections
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
        with self._lock:
            self.records.append(record)
            if self.path:
                try:
                    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                    with open(self.path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(record, sort_keys=True) + "\n")
                except OSError as exc:  # telemetry never costs a checkpoint; say so once per kind of failure
                    self.write_errors += 1
                    if exc.errno not in self._reported:
                        self._reported.add(exc.errno)
                        log.warning("[datastates] rank %d cannot write telemetry to %s: %s (checkpoints go on; "
                                    "further failures like this one are counted, not logged)",
                                    self.rank, self.path, exc.strerror or exc)
        rate = f", {record['gbps']:.2f} GB/s" if record.get("gbps") else ""
        took = f" in {seconds:.3f}s" if seconds is not None else ""
        log.info("[datastates] rank %d %s %s %s: %.1f MB%s%s%s", self.rank, checkpoint, event, level,
                 nbytes / 1e6, took, rate,
                 f", training blocked {extra['blocked_s']:.4f}s" if "blocked_s" in extra else "")
        return record
