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

Ordering between streams goes through ``stream_marks``: an event on the calling thread's current
stream of every CUDA device among some tensors (not only the first one's), which the save's copy
streams and restore's readers wait for before touching those tensors. ``CudaStreams`` holds the
few stream calls of the copy path, so the CPU tests can put a deferred stand-in in its place
(``tests/helpers/fake_cuda.py``).

The choice is plain Python; only ``rank_device``, ``bind_thread``, ``on_device``, ``stream_marks``
and ``CudaStreams`` call CUDA, and only with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable

import torch


def rank_device() -> int | None:
    """The CUDA device current on the calling (training) thread; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def cuda_index(tensor: Any) -> int | None:
    """The index of ``tensor``'s CUDA device (a device without an index is the first); None off a GPU."""
    device = tensor.device
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else 0


def cuda_device_of(tensors: Iterable[Any]) -> int | None:
    """The index of the first CUDA tensor's device among ``tensors``; None if none is on a GPU."""
    return next((index for index in map(cuda_index, tensors) if index is not None), None)


def cuda_devices_of(tensors: Iterable[Any]) -> list[int]:
    """Every CUDA device among ``tensors``, in the order they first appear (a file may span GPUs)."""
    return list(dict.fromkeys(index for index in map(cuda_index, tensors) if index is not None))


def thread_device(tensors_device: int | None, rank: int | None) -> int | None:
    """The device a thread binds to: that of the tensors it copies, else the rank's (None: no CUDA)."""
    return tensors_device if tensors_device is not None else rank


def bind_thread(device: int | None, set_device: Callable[[int], None] | None = None) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for None)."""
    if device is None:
        return
    (set_device or torch.cuda.set_device)(device)


def on_device(device: int | None) -> Any:
    """A context with ``device`` current on the calling thread, the previous one restored after
    (torch restores it only where a context exists: no context is made on GPU 0); None: nothing."""
    if device is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@dataclasses.dataclass(frozen=True)
class StreamMark:
    """A point on one device's stream: what was queued there before it must run before what waits for it."""

    device: int
    event: Any

    def wait(self) -> None:
        """Make the calling thread's current stream of ``device`` wait for the point (no host wait)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)


def stream_marks(tensors: Iterable[Any]) -> list[StreamMark]:
    """An event on the calling thread's current stream of each CUDA device among ``tensors`` (none without)."""
    marks = []
    for index in cuda_devices_of(tensors):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        marks.append(StreamMark(index, event))
    return marks


class CudaStreams:
    """The stream calls of the save's copy path (``save/flow/copier.py``), in one place so the CPU tests can
    replace them with a stand-in whose queued work runs only when waited for."""

    @staticmethod
    def device_of(tensor: torch.Tensor) -> int | None:
        return cuda_index(tensor)

    @staticmethod
    def marks(tensors: Iterable[Any]) -> list[StreamMark]:
        return stream_marks(tensors)

    @staticmethod
    def bind(device: int | None) -> None:
        bind_thread(device)

    @staticmethod
    def stream(device: int | None) -> Any:
        return torch.cuda.Stream(device=device)

    @staticmethod
    def launch(stream: Any, work: Callable[[], None]) -> None:
        """Queue ``work``'s copies on ``stream`` (they run later; ``record`` marks when)."""
        with torch.cuda.stream(stream):
            work()

    @staticmethod
    def make_on(stream: Any, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor made by a kernel queued on ``stream`` (its memory belongs to that stream)."""
        with torch.cuda.stream(stream):
            return work()

    @staticmethod
    def record(stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event


__all__ = ["CudaStreams", "StreamMark", "bind_thread", "cuda_device_of", "cuda_devices_of", "cuda_index",
           "on_device", "rank_device", "stream_marks", "thread_device"]
