"""Copy primitives: how bytes of a live tensor reach a host-cache slot.

One scheduler (``snapshot.py``) drives both primitives through the same four calls, so the CUDA
specific part stays in ``CudaCopier`` alone:

* ``mark()`` on the training thread at ``save`` time: CUDA records an event on the compute stream,
  so the copies are ordered after every kernel that produced the tensors.
* ``begin(mark)`` on the copy thread before a save's first copy: CUDA makes the copy stream wait
  for that event.
* ``copy(tensor, lo, hi, dst)``: bytes [lo, hi) of the tensor's row-major layout into ``dst``.
* ``chunk_ready()``: a callable the writer runs before reading the slot (CUDA: the event of the
  copies issued so far; CPU: nothing, copies are synchronous).

Tensors, and CUDA temporaries made by ``.contiguous()``, are kept referenced by the scheduler until
the save's last copy is known complete.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _noop() -> None:
    return None


def copy_elements(src: torch.Tensor, first: int, last: int, dst: torch.Tensor) -> None:
    """Copy elements [first, last) of ``src`` in row-major order into the flat ``dst``.

    Works for non-contiguous tensors without a temporary of the whole tensor: runs of whole rows
    of dimension 0 are copied as one view, partial rows recurse into the row.
    """
    if src.is_contiguous() or src.dim() <= 1:
        if last > first:
            dst.copy_(src.reshape(-1)[first:last], non_blocking=True)
        return
    row = src[0].numel()
    pos = 0
    while first < last:
        r, offset = divmod(first, row)
        if offset == 0 and last - first >= row:
            rows = (last - first) // row
            n = rows * row
            dst[pos:pos + n].view((rows,) + tuple(src.shape[1:])).copy_(src[r:r + rows], non_blocking=True)
        else:
            n = min(row - offset, last - first)
            copy_elements(src[r], offset, offset + n, dst[pos:pos + n])
        pos += n
        first += n


def copy_bytes(src: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
    """Copy bytes [lo, hi) of ``src``'s row-major image into the uint8 tensor ``dst``."""
    if src.is_contiguous():
        flat = src.reshape(-1).view(torch.uint8) if src.numel() else src.new_empty(0, dtype=torch.uint8)
        dst.copy_(flat[lo:hi], non_blocking=True)
        return
    size = src.element_size()
    # The file layout keeps every tensor element-aligned within chunks (layout.py), so this holds.
    assert lo % size == 0 and hi % size == 0, "chunk boundary splits an element"
    copy_elements(src, lo // size, hi // size, dst.view(src.dtype))


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

    def chunk_ready(self) -> Callable[[], None]:
        return _noop

    def finish(self) -> None:
        return None


class CudaCopier(CpuCopier):
    """Device-to-host copies on a private stream, ordered after the compute stream by an event.

    Not executed by the CPU test suite (no GPU here); kept to these few lines on purpose.
    """

    def __init__(self, device: torch.device | None = None):
        self.stream = torch.cuda.Stream(device=device)

    def mark(self, tensors: list[torch.Tensor]) -> Any:
        if not any(t.is_cuda for t in tensors):
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def begin(self, mark: Any) -> None:
        if mark is not None:
            self.stream.wait_event(mark)

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        # A contiguous temporary made on the copy stream; the scheduler keeps it until finish().
        if tensor.is_cuda and not tensor.is_contiguous():
            with torch.cuda.stream(self.stream):
                return tensor.contiguous()
        return tensor

    def copy(self, tensor: torch.Tensor, lo: int, hi: int, dst: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            copy_bytes(tensor, lo, hi, dst)

    def chunk_ready(self) -> Callable[[], None]:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event.synchronize

    def finish(self) -> None:
        self.stream.synchronize()


def make_copier(use_cuda: bool) -> CpuCopier:
    return CudaCopier() if use_cuda else CpuCopier()
