"""The copy lanes of the interleaved step: CUDA streams, and a CPU stand-in that defers copies.

Three lanes: ``compute`` (the current stream: updates and device-to-device copies), ``h2d``
(prefetch of state, updated weights to the device) and ``d2h`` (gradients and write-back to the
host). A copy on ``h2d`` or ``d2h`` is asynchronous; it is ordered against other lanes only
through ``record``ed events that a lane ``wait``s for or the host ``host_wait``s for.

``DeferredCpuLanes`` is the stand-in on CPU-only machines: each side-lane copy fills its
destination with NaN at once (unless it is queued behind a wait of its lane, which it may not
overtake) and runs only when an event recorded after it is waited for, so a
missing wait leaves NaN where the real GPU would have raced. ``drop_waits`` (labels) lets a test
remove a wait and see it caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIDE_LANES = ("h2d", "d2h")


class CudaLanes:
    """Side streams on ``device``; the compute lane is the current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.lanes = {"compute": self.compute, "h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}

    def copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.lanes[lane]):
            dst.copy_(src, non_blocking=True)

    def record(self, lane: str, label: str) -> torch.cuda.Event:
        return self.lanes[lane].record_event()

    def wait(self, lane: str, event: torch.cuda.Event) -> None:
        self.lanes[lane].wait_event(event)

    def wait_compute(self, lane: str) -> None:
        """``lane``'s later work runs after all the compute lane's work so far (gradients are ready)."""
        self.lanes[lane].wait_stream(self.compute)

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()


@dataclass(frozen=True)
class DeferredEvent:
    lane: str
    position: int
    label: str


class DeferredCpuLanes:
    """The CPU stand-in: compute is immediate; side-lane copies run in order, when waited for.

    A side lane waiting for an event runs nothing yet (as on a GPU, where the host does not
    block): the dependency is queued and honoured when that lane's later copies run."""

    def __init__(self, drop_waits: tuple[str, ...] = ()):
        self.device = torch.device("cpu")
        self.drop_waits = frozenset(drop_waits)
        self.pending: dict[str, list[tuple]] = {lane: [] for lane in SIDE_LANES}
        self.done = {lane: 0 for lane in SIDE_LANES}

    def copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if lane == "compute":
            dst.copy_(src)
            return
        queue = self.pending[lane]
        behind_a_wait = any(isinstance(op, DeferredEvent) for op in queue[self.done[lane]:])
        if dst.is_floating_point() and not behind_a_wait:  # behind a wait it may not start yet
            dst.fill_(float("nan"))
        queue.append((dst, src))

    def record(self, lane: str, label: str) -> DeferredEvent:
        return DeferredEvent(lane, len(self.pending[lane]) if lane in SIDE_LANES else 0, label)

    def _run_until(self, event: DeferredEvent) -> None:
        if event.label in self.drop_waits or event.lane not in SIDE_LANES:
            return
        queue = self.pending[event.lane]
        while self.done[event.lane] < event.position:
            op = queue[self.done[event.lane]]
            self.done[event.lane] += 1
            if isinstance(op, DeferredEvent):
                self._run_until(op)
            else:
                op[0].copy_(op[1])

    def wait(self, lane: str, event: DeferredEvent) -> None:
        if lane in SIDE_LANES:
            self.pending[lane].append(event)
        else:
            self._run_until(event)

    def wait_compute(self, lane: str) -> None:
        pass  # compute is immediate here: whatever it wrote is already there

    def host_wait(self, event: DeferredEvent) -> None:
        self._run_until(event)

    def reset(self) -> None:
        """Forget copies no one waited for (between steps: the queues would otherwise grow)."""
        for lane in SIDE_LANES:
            self.pending[lane] = self.pending[lane][self.done[lane]:]
            self.done[lane] = 0


def lanes_for(device: torch.device, drop_waits: tuple[str, ...] = ()):
    return CudaLanes(device) if device.type == "cuda" else DeferredCpuLanes(drop_waits)
