"""Planning a read of a committed tensor file: which bytes, in which requests, through which descriptor.

The byte ranges of the wanted tensors come from the manifest (no header parsing, no
unpickling). They are merged into spans when close (``merged_spans``), cut into pieces of at
most ``READ_PIECE`` bytes, each knowing the tensor bytes it carries (``plan_pieces``), and read
with ``preadv`` until complete (``read_fully``). ``open_for_read`` chooses buffered or
``O_DIRECT``; the thread pools are shared by every reader of the process. ``fast_read`` and
``staged_read`` execute these plans.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import mmap
import os
import threading

import torch
import xxhash

from ..errors import CheckpointError
from ..files import ALIGN, open_regular, round_up
from ..format.entries import TensorEntry
from ..threads import name_os_thread

O_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)
#: Bytes one thread reads per request: large enough to stream, small enough to spread over threads.
READ_PIECE = 8 << 20
#: Ranges closer than this are read as one (reading a small gap is cheaper than another request).
MERGE_GAP = 256 << 10
#: At most this many buffers per ``preadv`` call (Linux's IOV_MAX).
_IOV_MAX = 1024

_pools: dict[tuple[str, int], cf.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(kind: str, threads: int) -> cf.ThreadPoolExecutor:
    """One lazily created pool per kind and size, shared by every reader of the process."""
    with _pools_lock:
        pool = _pools.get((kind, threads))
        if pool is None:
            pool = _pools[(kind, threads)] = cf.ThreadPoolExecutor(threads, thread_name_prefix=f"datastates-{kind}",
                                                                 initializer=name_os_thread)
        return pool


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` starting on a 4 KiB boundary (``O_DIRECT`` needs it)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip: skip + nbytes]


def open_for_read(path: str, o_direct: bool | str) -> tuple[int, bool]:
    """(fd, direct): ``O_DIRECT`` when ``o_direct`` is True (an error if refused), else buffered.

    ``"auto"`` reads buffered (``fast_read``'s module docstring says why). Only a regular file is opened,
    never through a symbolic link (a checkpoint's files are its own). The ``O_DIRECT`` probe is
    one aligned 4 KiB read of the file's first block (every tensor file has one: the header is
    padded to 4 KiB), so nothing is written next to the checkpoint.
    """
    fd = open_regular(path)
    if o_direct is not True:
        return fd, False
    refused = f"o_direct is true but {os.path.dirname(path)} refuses O_DIRECT reads"
    try:
        if not O_DIRECT_FLAG:
            raise CheckpointError("o_direct is true but this platform has no O_DIRECT")
        try:
            direct = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | O_DIRECT_FLAG)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise CheckpointError(refused) from None
            raise CheckpointError(f"{path}: cannot be opened: {exc.strerror or exc}") from None
        probe = mmap.mmap(-1, ALIGN)
        try:
            if os.fstat(direct).st_ino != os.fstat(fd).st_ino:
                raise CheckpointError(f"{path}: replaced while it was being opened")
            os.preadv(direct, [probe], 0)
        except BaseException as exc:
            os.close(direct)
            if isinstance(exc, OSError):
                if exc.errno == errno.EINVAL:
                    raise CheckpointError(refused) from None
                raise CheckpointError(f"reading {path} failed: {exc.strerror or exc}") from None
            raise
        finally:
            probe.close()
        return direct, True
    finally:
        os.close(fd)


def merged_spans(ranges: list[tuple[int, int]], size: int, align: bool = True) -> list[tuple[int, int]]:
    """[start, end) spans covering ``ranges`` (non-empty, sorted), merged when close; widened to
    4 KiB boundaries when ``align`` (O_DIRECT needs it)."""
    spans: list[list[int]] = []
    for begin, end in ranges:
        lo, hi = (begin // ALIGN * ALIGN, min(round_up(end), round_up(size))) if align else (begin, end)
        if spans and lo <= spans[-1][1] + MERGE_GAP:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(lo, hi) for lo, hi in spans]


@dataclasses.dataclass(eq=False)
class Piece:
    """One read request: file bytes [off, off + length) and the tensor bytes it carries."""

    off: int
    length: int  # may run past the end of the file (O_DIRECT reads whole blocks); reads stop there
    segments: list[tuple[str, int, int]]  # (tensor, file lo, file hi) within the piece
    buf_off: int = 0  # where the piece lands in a single buffer (``read_tensors``)
    done: bool = False


def plan_pieces(metas: dict[str, TensorEntry], order: list[str], spans: list[tuple[int, int]],
                step: int) -> list[Piece]:
    """Cut ``spans`` into pieces of at most ``step`` bytes, each knowing the tensors it carries."""
    pieces: list[Piece] = []
    i = 0
    packed = 0  # bytes of the spans before this piece: its place in a single buffer
    for lo_span, hi_span in spans:
        for off in range(lo_span, hi_span, step):
            end = min(off + step, hi_span)
            while i < len(order) and metas[order[i]].end <= off:
                i += 1
            segments = []
            j = i
            while j < len(order) and metas[order[j]].begin < end:
                b, e = metas[order[j]].begin, metas[order[j]].end
                if e > off:
                    segments.append((order[j], max(b, off), min(e, end)))
                j += 1
            pieces.append(Piece(off, end - off, segments, packed + off - lo_span))
        packed += hi_span - lo_span
    return pieces


def read_fully(fd: int, buffers: list[memoryview], off: int, want: int, path: str) -> None:
    """Fill ``buffers`` in order from file offset ``off`` until ``want`` bytes (the rest is past the end)."""
    got, first = 0, 0
    while got < want:
        n = os.preadv(fd, buffers[first: first + _IOV_MAX], off + got)
        if n == 0:
            raise CheckpointError(f"{path} is truncated (ends before byte {off + want})")
        got += n
        while n and first < len(buffers):
            if n >= len(buffers[first]):
                n -= len(buffers[first])
                first += 1
            else:
                buffers[first] = buffers[first][n:]
                n = 0


def cancel_and_wait(futures: list[cf.Future], timeout: float) -> None:
    """After a failure: cancel what has not started, wait for what has (it uses the file and buffers)."""
    for future in futures:
        future.cancel()
    cf.wait(futures, timeout=timeout)


def digest_of(view: torch.Tensor) -> str:
    # ``update`` releases the GIL above 64 KiB; the one-shot ``xxh3_64_hexdigest`` never does, which
    # would serialise the hashing pool with the reading threads and the caller.
    digest = xxhash.xxh3_64()
    digest.update(memoryview(view.numpy()))
    return digest.hexdigest()
