"""Starting torchrun jobs on this machine: what the main job, benchmarks and tests share."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """``python -m torch.distributed.run`` on one node with ``nproc`` processes running ``target``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *target]
