"""Crash tests: wait (bounded) until a checkpoint is committed before the kill.

Commits trail the saves by however long the slowest rank's flush takes, so on a loaded machine
a kill a few iterations in can find nothing committed yet. The harnesses wait here, right before
the save of the iteration they kill at, so the crash always leaves a committed checkpoint
behind while the checkpoints after it are still in flight.
"""

from __future__ import annotations

import sys
import time
from typing import Callable


def await_tracker(path: str, at_least: int, parse: Callable[[str], int], timeout_s: float = 300.0) -> int:
    """Poll the tracker file ``path`` until ``parse`` of it is ``at_least`` or more; returns that value.

    A missing file or one ``parse`` refuses (caught mid-write, ``ValueError``) counts as nothing
    committed yet. Past ``timeout_s`` this exits with an error naming the file.
    """
    start = time.monotonic()
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                committed = parse(f.read().strip())
        except (FileNotFoundError, ValueError):
            committed = None
        if committed is not None and committed >= at_least:
            print(f"[harness] {path} names {committed} after {time.monotonic() - start:.2f}s of waiting; "
                  "the kill follows this iteration's save call", file=sys.stderr, flush=True)
            return committed
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"no checkpoint of iteration {at_least} or later was committed within "
                             f"{timeout_s:.0f}s ({path}: {committed})")
        time.sleep(0.05)
