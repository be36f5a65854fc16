"""CUDA streams stood in for on the CPU: queued work runs only once something waits for it.

A real stream runs its work later, at a time nobody should rely on; this stand-in runs it at the
*latest* moment the program's waits allow (an event synchronised, a stream waiting for an event,
a stream synchronised, or ``drain`` at the end). So a copy not ordered after the kernel that
wrote its source reads the old values, and a destination nobody waited for is still what it was
before (the tests fill it with NaN). Tensors are host tensors; ``place`` gives one a fake device
id. ``FakeCuda`` implements ``megatron_ext.engine.device.CudaStreams``'s calls.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch


class FakeStream:
    """An ordered queue of work; ``run_to(n)`` runs the first ``n`` items (each once, in order)."""

    def __init__(self, device: int | None, name: str):
        self.device, self.name = device, name
        self.work: list[Callable[[], Any]] = []
        self.done = 0
        self.lock = threading.RLock()

    def queue(self, work: Callable[[], Any]) -> None:
        with self.lock:
            self.work.append(work)

    def run_to(self, n: int) -> None:
        with self.lock:
            while self.done < n:
                item = self.work[self.done]
                self.done += 1
                item()

    def synchronize(self) -> None:
        self.run_to(len(self.work))

    def wait_event(self, event: "FakeEvent") -> None:
        """Later work here runs only after the event's point on its stream."""
        self.queue(lambda: event.synchronize())


@dataclasses.dataclass
class FakeEvent:
    stream: FakeStream
    point: int

    def synchronize(self) -> None:
        self.stream.run_to(self.point)


@dataclasses.dataclass(frozen=True)
class FakeMark:
    """``device.StreamMark``'s stand-in: the caller's stream at ``mark`` time."""

    device: int
    event: FakeEvent

    def wait(self) -> None:
        # The waiting thread's next copy is synchronous on the host: waiting means the work before
        # the point has run.
        self.event.synchronize()


class FakeCuda:
    """The calls of ``device.CudaStreams``, on host tensors with fake device ids."""

    def __init__(self) -> None:
        self.placed: dict[int, int] = {}  # storage address -> fake device
        self.compute: dict[int, FakeStream] = {}  # each device's caller (compute) stream
        self.made: list[FakeStream] = []
        self.bound: list[int | None] = []

    def place(self, tensor: torch.Tensor, device: int) -> torch.Tensor:
        self.placed[tensor.untyped_storage().data_ptr()] = device
        return tensor

    def compute_stream(self, device: int) -> FakeStream:
        return self.compute.setdefault(device, FakeStream(device, f"compute{device}"))

    def queue_kernel(self, device: int, work: Callable[[], Any]) -> None:
        """Work the caller queued on its current stream of ``device`` (not run yet)."""
        self.compute_stream(device).queue(work)

    def drain(self) -> None:
        """Run whatever is still queued anywhere (the program's end)."""
        for stream in [*self.compute.values(), *self.made]:
            stream.synchronize()

    # -- device.CudaStreams
    def device_of(self, tensor: torch.Tensor) -> int | None:
        return self.placed.get(tensor.untyped_storage().data_ptr())

    def marks(self, tensors) -> list[FakeMark]:
        devices: list[int] = []
        for t in tensors:
            d = self.device_of(t)
            if d is not None and d not in devices:
                devices.append(d)
        return [self.mark(d) for d in devices]

    def mark(self, device: int) -> FakeMark:
        stream = self.compute_stream(device)
        return FakeMark(device, FakeEvent(stream, len(stream.work)))

    def bind(self, device: int | None) -> None:
        self.bound.append(device)

    def stream(self, device: int | None) -> FakeStream:
        stream = FakeStream(device, f"copy{device}")
        self.made.append(stream)
        return stream

    def launch(self, stream: FakeStream, work: Callable[[], None]) -> None:
        stream.queue(work)

    def make_on(self, stream: FakeStream, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream.synchronize()  # the new tensor's kernel runs after what the stream holds
        made = work()
        if stream.device is not None:
            self.place(made, stream.device)
        return made

    def record(self, stream: FakeStream) -> FakeEvent:
        return FakeEvent(stream, len(stream.work))
