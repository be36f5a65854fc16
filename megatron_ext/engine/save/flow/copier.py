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

Tensors are kept referenced by the scheduler until the save's last copy is known complete. A
CUDA temporary made by ``.contiguous()`` is made when its tensor's first bytes are copied and
dropped once its last are queued: never all of a file's at once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...device import CudaStreams, StreamMark, thread_device

if TYPE_CHECKING:
    from ...format.tensor_file import FileLayout


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

    def copy_range(self, layout: "FileLayout", start: int, end: int, dst: torch.Tensor, first: int,
                   source: Callable[[int], torch.Tensor]) -> int:
        """The tensor bytes of file range [start, end) of ``layout`` into ``dst`` (its bytes, at offset
        0), in one batched copy; ``source(k)`` is what tensor ``k`` is copied from. ``first`` and the
        return value: the first tensor this range and the next may overlap (``FileLayout.spans_in``).
        The live snapshot and ``OfflineWriter`` both fill their buffers through it; the header's
        bytes are the caller's (``FileLayout.header_in``)."""
        found, first = layout.spans_in(start, end, first)
        spans = layout.spans
        self.copy_many([(source(k), lo - spans[k].start, hi - spans[k].start, dst[lo - start:hi - start])
                        for k, lo, hi in found])
        return first

    def chunk_ready(self) -> Callable[[], None]:
        return _noop

    def finish(self) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class CudaMark:
    """A save's CUDA tensors: an event after the kernels that produced them on each of their devices
    (``device.stream_marks``); ``device`` is the first one's, where the copy thread binds."""

    marks: tuple[StreamMark, ...]

    @property
    def device(self) -> int:
        return self.marks[0].device


class CudaCopier(CpuCopier):
    """Device-to-host copies on a private stream per device, ordered after the compute stream by an event.

    A file may hold tensors of several GPUs: each device's copies go on that device's copy stream,
    which first waits for that device's event; ``chunk_ready`` and ``finish`` cover every stream
    the save used. ``device`` is the rank's (``device.rank_device``), for saves without CUDA
    tensors. The stream calls go through ``cuda`` (``device.CudaStreams``): the CPU tests run this
    class on a deferred stand-in (tests/engine/test_cuda_logic.py).
    """

    def __init__(self, device: int | None = None, cuda: Any = None):
        self.device = device
        self.cuda = cuda if cuda is not None else CudaStreams()
        self.streams: dict[int | None, Any] = {}  # made on the copy thread, once bound to their device
        self.used: dict[int | None, Any] = {}  # the current save's streams, by device
        self.stream: Any = None  # the current save's first (its bound device's)

    def _stream(self, device: int | None) -> Any:
        if device not in self.streams:
            self.streams[device] = self.cuda.stream(device)
        self.used[device] = self.streams[device]
        return self.streams[device]

    def mark(self, tensors: list[torch.Tensor]) -> Any:
        marks = self.cuda.marks(tensors)
        return CudaMark(tuple(marks)) if marks else None

    def begin(self, mark: Any) -> None:
        device = thread_device(mark.device if mark is not None else None, self.device)
        self.cuda.bind(device)
        self.used = {}
        self.stream = self._stream(device)
        for point in mark.marks if mark is not None else ():
            self._stream(point.device).wait_event(point.event)

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        # A contiguous temporary made on its device's copy stream, which alone reads it: the
        # scheduler may drop it once its last copy is queued (the allocator reuses it in stream order).
        device = self.cuda.device_of(tensor)
        if device is not None and not tensor.is_contiguous():
            return self.cuda.make_on(self._stream(device), tensor.contiguous)
        return tensor

    def copy(self, tensor: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
        self.copy_many([(tensor, lo, hi, dst)])

    def copy_many(self, parts: list[Part]) -> None:
        # Each device's parts queued on its copy stream by one call (the GIL is held only to launch them).
        groups: dict[int | None, list[Part]] = {}
        for part in parts:
            groups.setdefault(self.cuda.device_of(part[0]), []).append(part)
        for device, group in groups.items():
            stream = self._stream(device) if device is not None else self.stream
            self.cuda.launch(stream, lambda group=group: copy_parts(group, non_blocking=True))

    def chunk_ready(self) -> Callable[[], None]:
        events = [self.cuda.record(stream) for stream in self.used.values()]

        def ready() -> None:
            for event in events:
                event.synchronize()

        return ready

    def finish(self) -> None:
        for stream in self.used.values():  # none: nothing was copied yet (a save abandoned before its first copy)
            stream.synchronize()


def make_copier(use_cuda: bool, device: int | None = None) -> CpuCopier:
    return CudaCopier(device) if use_cuda else CpuCopier()
