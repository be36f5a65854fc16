"""Telemetry: one JSON line per checkpoint and level, and one short human line in the log."""

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
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record, sort_keys=True) + "\n")
        rate = f", {record['gbps']:.2f} GB/s" if record.get("gbps") else ""
        took = f" in {seconds:.3f}s" if seconds is not None else ""
        log.info("[datastates] rank %d %s %s %s: %.1f MB%s%s%s", self.rank, checkpoint, event, level,
                 nbytes / 1e6, took, rate,
                 f", training blocked {extra['blocked_s']:.4f}s" if "blocked_s" in extra else "")
        return record
