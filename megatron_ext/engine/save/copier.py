"""Copy primitives: how bytes of a live tensor reach a host-cache slot.

One scheduler (``snapshot.py``) drives both primitives through the same four calls, so the CUDA
specific part stays in ``CudaCopier`` alone:

* ``mark()`` on the training thread at ``save`` time: CUDA records an event on the compute stream
  of the tensors' device, so the copies are ordered after every kernel that produced the tensors.
* ``begin(mark)`` on the copy thread before a save's first copy: CUDA binds the thread to that
  device (``device.py``; else the rank's) and makes that device's copy stream wait for the event.
* ``copy(tensor, lo, hi, dst)``: bytes [lo, hi) of the tensor's row-major layout into ``dst``;
  ``copy_many(parts)`` does a list of those (every part of a run of cache slots) at once: on CPU one
  ``torch._foreach_copy_`` call, so the copy thread takes the GIL back once per run, not per tensor
  (each time it does, a Python-bound training thread loses a round trip; docs/ARCHITECTURE.md).
* ``chunk_ready()``: a callable the writer runs before reading the slot (CUDA: the event of the
  copies issued so far; CPU: nothing, copies are synchronous).

Every torch call releases the GIL and takes it back, which on the copy thread costs a Python-bound
training thread one forced switch each time. So ``save`` turns each contiguous tensor into a flat
byte view on the training thread (``byte_source``), the copy thread only slices those (indexing
keeps the GIL), and each run of cache slots is one ``torch._foreach_copy_`` call, on CPU and CUDA
alike: a checkpoint costs the training thread a few switches per run, not two per tensor.

Tensors, and CUDA temporaries made by ``.contiguous()``, are kept referenced by the scheduler until
the save's last copy is known complete.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..device import bind_thread, cuda_device_of, thread_device


def _noop() -> None:
    return None


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def element_pairs(src: torch.Tensor, first: int, last: int, dst: torch.Tensor,
                  out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append to ``out`` the (destination, source) views that copy elements [first, last) of ``src``,
    in row-major order, into the flat ``dst``.

    Works for non-contiguous tensors without a temporary of the whole tensor: runs of whole rows
    of dimension 0 are one pair, partial rows recurse into the row.
    """
    if src.is_contiguous() or src.dim() <= 1:
        if last > first:
            out.append((dst, src.reshape(-1)[first:last]))
        return
    row = src[0].numel()
    pos = 0
    while first < last:
        r, offset = divmod(first, row)
        if offset == 0 and last - first >= row:
            rows = (last - first) // row
            n = rows * row
            out.append((dst[pos:pos + n].view((rows,) + tuple(src.shape[1:])), src[r:r + rows]))
        else:
            n = min(row - offset, last - first)
            element_pairs(src[r], offset, offset + n, dst[pos:pos + n], out)
        pos += n
        first += n


def byte_source(tensor: torch.Tensor) -> torch.Tensor:
    """What the copy thread reads ``tensor``'s bytes from: a flat uint8 view of a contiguous tensor
    (made here, on the caller's thread), else the tensor itself (copied by rows, ``element_pairs``)."""
    if tensor.is_contiguous():
        return tensor.reshape(-1).view(torch.uint8)
    return tensor


def byte_pairs(src: torch.Tensor, lo: int, hi: int, dst: torch.Tensor,
               out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append the (destination, source) views that copy bytes [lo, hi) of ``src``'s row-major image
    into the uint8 tensor ``dst``. A flat uint8 ``src`` (``byte_source``) is only sliced: no torch
    call that releases the GIL."""
    if src.dtype == torch.uint8 and src.dim() == 1:
        if hi > lo:
            out.append((dst, src[lo:hi]))
        return
    if src.is_contiguous():
        if hi > lo:
            out.append((dst, src.reshape(-1).view(torch.uint8)[lo:hi]))
        return
    size = src.element_size()
    # The file layout keeps every tensor element-aligned within chunks (layout.py), so this holds.
    assert lo % size == 0 and hi % size == 0, "chunk boundary splits an element"
    element_pairs(src, lo // size, hi // size, dst.view(src.dtype), out)


def copy_elements(src: torch.Tensor, first: int, last: int, dst: torch.Tensor) -> None:
    """Copy elements [first, last) of ``src`` in row-major order into the flat ``dst``."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    element_pairs(src, first, last, dst, pairs)
    for d, s in pairs:
        d.copy_(s, non_blocking=True)


def copy_bytes(src: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
    """Copy bytes [lo, hi) of ``src``'s row-major image into the uint8 tensor ``dst``."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    byte_pairs(src, lo, hi, dst, pairs)
    for d, s in pairs:
        d.copy_(s, non_blocking=True)


Part = tuple[torch.Tensor, int, int, torch.Tensor]  # (tensor, lo, hi, destination bytes)


def copy_parts(parts: list[Part], non_blocking: bool) -> None:
    """Bytes [lo, hi) of every part's tensor into its destination, in one ``torch._foreach_copy_``
    (device-to-host copies are queued on the current stream when ``non_blocking``)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tensor, lo, hi, dst in parts:
        byte_pairs(tensor, lo, hi, dst, pairs)
    if not pairs:
        return
    if _foreach_copy is None:  # older torch: one call per part
        for d, s in pairs:
            d.copy_(s, non_blocking=non_blocking)
        return
    _foreach_copy([d for d, _ in pairs], [s for _, s in pairs], non_blocking=non_blocking)


class CpuCopier:
    """Synchronous copies on the copy thread; torch releases the GIL inside ``copy_``."""

    def mark(self, tensors: list[torch.Tensor]) -> Any:
        return None

    def begin(self, mark: Any) -> None:
        return None

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def copy(self, tensor: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
        copy_bytes(tensor, lo, hi, dst)

    def copy_many(self, parts: list[Part]) -> None:
        """Every part in one ``torch._foreach_copy_`` call: the GIL is released once for all of them."""
        copy_parts(parts, non_blocking=False)

    def chunk_ready(self) -> Callable[[], None]:
        return _noop

    def finish(self) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class CudaMark:
    """A save's CUDA tensors: the device they are on and an event after the kernels that produced them."""

    event: Any
    device: int


class CudaCopier(CpuCopier):
    """Device-to-host copies on a private stream per device, ordered after the compute stream by an event.

    ``device`` is the rank's (``device.rank_device``), for saves without CUDA tensors. Not
    executed by the CPU test suite (no GPU here); kept to these few lines on purpose.
    """

    def __init__(self, device: int | None = None):
        self.device = device
        self.streams: dict[int | None, Any] = {}  # made on the copy thread, once bound to their device
        self.stream: Any = None  # the current save's

    def mark(self, tensors: list[torch.Tensor]) -> Any:
        device = cuda_device_of(tensors)
        if device is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return CudaMark(event, device)

    def begin(self, mark: Any) -> None:
        device = thread_device(mark.device if mark is not None else None, self.device)
        bind_thread(device)
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)
        self.stream = self.streams[device]
        if mark is not None:
            self.stream.wait_event(mark.event)

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        # A contiguous temporary made on the copy stream; the scheduler keeps it until finish().
        if tensor.is_cuda and not tensor.is_contiguous():
            with torch.cuda.stream(self.stream):
                return tensor.contiguous()
        return tensor

    def copy(self, tensor: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            copy_bytes(tensor, lo, hi, dst)

    def copy_many(self, parts: list[Part]) -> None:
        # Every copy queued on the copy stream by one call (the GIL is held only to launch them).
        with torch.cuda.stream(self.stream):
            copy_parts(parts, non_blocking=True)

    def chunk_ready(self) -> Callable[[], None]:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.synchronize

    def finish(self) -> None:
        if self.stream is not None:  # None: nothing was copied yet (a save abandoned before its first copy)
            self.stream.synchronize()


def make_copier(use_cuda: bool, device: int | None = None) -> CpuCopier:
    return CudaCopier(device) if use_cuda else CpuCopier()
