"""Read-ahead hints: the kernel starts reading a checkpoint's files into the page cache while the
loader is still preparing (building its state dict, allocating the optimizer's state), so the
reads that follow find their bytes on the way or already there. Buffered reads only: ``O_DIRECT``
bypasses the page cache.

A hint that is not taken changes nothing but speed, and the read that follows reports the
problem with the file itself; so a failed hint is logged, not raised.
"""

from __future__ import annotations

import logging
import os
import threading

from ..errors import CheckpointError
from ..files import open_regular

log = logging.getLogger("megatron_ext.engine")


class Prefetch:
    """``POSIX_FADV_WILLNEED`` over whole files, on a thread of its own (the call allocates the page
    cache and queues the reads, which for gigabytes takes a while; the GIL is released meanwhile)."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self.problems: list[str] = []
        self._thread = threading.Thread(target=self._advise, name="datastates-prefetch", daemon=True)
        self._thread.start()

    def _advise(self) -> None:
        for path in self.paths:
            try:
                fd = open_regular(path)
            except CheckpointError as exc:
                self.problems.append(str(exc))
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError as exc:
                self.problems.append(f"{path}: {exc.strerror or exc}")
            finally:
                os.close(fd)

    def finish(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the hints to be given; log those not taken."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.info("[datastates] read-ahead hints still being given after %.0fs; not waiting", timeout_s)
        for problem in self.problems:
            log.info("[datastates] read-ahead hint not taken: %s", problem)


__all__ = ["Prefetch"]
