"""Background work that must not take a core from the training thread: the lowest CPU priority.

Linux keeps a nice value per thread, so a thread of the engine (the host cache's pre-faulting, the
I/O worker's checksum beside a write on a rank without a core to spare) can yield to everything
else of its process while the rest runs at normal priority.
"""

from __future__ import annotations

import os
import sys
import threading


def lowest_cpu_priority() -> None:
    """Nice 19 for the calling thread only; elsewhere, or where a sandbox refuses it, nothing."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
