"""The CUDA device each engine thread works on: the rank's, never GPU 0 by default.

A new thread starts with CUDA device 0 current, whatever the thread that started it had set; its
first CUDA call (a pinned allocation, a stream, an event, a copy's synchronisation) then makes
GPU 0's context current there, creating it if needed: from every rank of a node, each costing
GPU 0 memory. So every engine thread that touches CUDA binds itself first: the snapshot thread
and the checksum and write threads (at their start and, per saved file, to the device of the
file's CUDA tensors), the host cache's allocation thread (pinning), and restore's readers (to
the device of the tensors they fill). Without tensors to say otherwise, the device is the one
current on the training thread when the engine was built (``rank_device``), which trainers set
to the rank's GPU (``torch.cuda.set_device(local_rank)``) before anything else.

The choice is plain Python; only ``rank_device`` and ``bind_thread`` call CUDA, and only with it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def rank_device() -> int | None:
    """The CUDA device current on the calling (training) thread; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def cuda_device_of(tensors: Iterable[Any]) -> int | None:
    """The index of the first CUDA tensor's device among ``tensors``; None if none is on a GPU."""
    for tensor in tensors:
        device = tensor.device
        if device.type == "cuda":
            return device.index if device.index is not None else 0
    return None


def thread_device(tensors_device: int | None, rank: int | None) -> int | None:
    """The device a thread binds to: that of the tensors it copies, else the rank's (None: no CUDA)."""
    return tensors_device if tensors_device is not None else rank


def bind_thread(device: int | None, set_device: Callable[[int], None] | None = None) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for None)."""
    if device is None:
        return
    (set_device or torch.cuda.set_device)(device)


__all__ = ["bind_thread", "cuda_device_of", "rank_device", "thread_device"]
