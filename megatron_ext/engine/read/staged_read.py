"""Reading into tensors that already exist (a model's, on the host or a GPU), through staging where needed.

The memory of freshly allocated tensors must be faulted in page by page, which on some machines
costs more than the disk read itself; reading into existing tensors avoids it. Buffered reads
scatter straight into host targets; ``O_DIRECT`` reads land in a ``Staging``'s aligned slots and
are copied from there; GPU targets are filled by ``stream_into``, which takes the pieces in file
order through a few reused (pinned) slots instead of one host buffer the size of the file.
The planning is ``read_plan``'s, the region-by-region reading ``fast_read``'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from typing import Callable, Iterable, Protocol

import torch
import xxhash

from ..device import bind_thread, cuda_device_of, rank_device, stream_marks
from ..errors import CacheError, CheckpointError
from ..format.entries import ListedFile, TensorEntry
from ..host_cache import HostCache
from .fast_read import RegionReads, check_hashes, read_tensors
from .read_plan import (
    MERGE_GAP,
    READ_PIECE,
    Piece,
    cancel_and_wait,
    digest_of,
    merged_spans,
    open_for_read,
    plan_pieces,
    read_fully,
    shared_pool,
)

#: Smaller staging slots than this cost more in requests than they save; a default pool is used instead.
MIN_STAGING_CHUNK = 1 << 20


class Staging(Protocol):
    """Aligned, resident chunk slots (the engine's ``HostCache``): O_DIRECT reads land here, then go to tensors."""

    chunk_bytes: int

    num_slots: int

    def acquire(self, timeout: float, check: Callable[[], None] = ...) -> int: ...
    def release(self, slot: int) -> None: ...
    def wake(self) -> None: ...
    def view(self, slot: int) -> torch.Tensor: ...
    def memory(self, slot: int, nbytes: int) -> memoryview: ...


def _byte_views(metas: dict[str, TensorEntry], targets: dict[str, torch.Tensor],
                names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Byte views of the targets ``names`` that hold bytes in the file, in file order (filled in place)."""
    order = sorted((n for n in names if metas[n].end > metas[n].begin), key=lambda n: metas[n].begin)
    return {n: targets[n].detach().reshape(-1).view(torch.uint8) for n in order}


def read_into(path: str, listed: ListedFile, targets: dict[str, torch.Tensor], staging: Staging, *, verify: bool = True,
              o_direct: bool | str = "auto", threads: int = 4, timeout_s: float = 1800.0) -> None:
    """Fill existing tensors (e.g. a model's) with their saved bytes; checksums from the filled tensors.

    The memory of freshly allocated tensors must be faulted in page by page, which on some
    machines costs more than the disk read itself; reading into tensors that already exist avoids
    it. Buffered reads land in host tensors directly; O_DIRECT reads land in ``staging``'s aligned
    slots first and are copied from there. Device tensors are filled through the slots by
    ``stream_into``; strided ones (rare) from a fresh host buffer of their own.
    """
    metas = listed.select(targets)
    for name, target in targets.items():
        meta = metas[name]
        if meta.dtype != target.dtype or meta.shape != tuple(target.shape):
            raise CheckpointError(f"{path}: tensor {name!r} is {meta.saved_as} in the checkpoint, "
                                  f"the target is {target.dtype}{list(target.shape)}: the template is not the model "
                                  "that was saved (load() returns the state as saved)")
    strided = {n: t for n, t in targets.items() if not t.is_contiguous()}
    device = {n: t for n, t in targets.items() if n not in strided and t.device.type != "cpu"}
    if strided:  # rare: a fresh host buffer of just these tensors (pinned on a GPU node), then copies
        fresh = read_tensors(path, listed, list(strided), verify=verify, o_direct=o_direct, threads=threads,
                             pin=torch.cuda.is_available(), timeout_s=timeout_s)
        for name, target in strided.items():
            target.copy_(fresh[name])
    if device:
        stream_into(path, listed, device, staging, verify=verify, o_direct=o_direct, threads=threads,
                    timeout_s=timeout_s)
    flat = _byte_views(metas, targets, [n for n in targets if n not in strided and n not in device])
    if not flat:
        return
    order = list(flat)
    size = listed.file.size
    deadline = time.monotonic() + timeout_s
    fd, direct = open_for_read(path, o_direct)
    ranges = [(metas[n].begin, metas[n].end) for n in order]
    if direct:
        pieces = plan_pieces(metas, order, merged_spans(ranges, size), min(READ_PIECE, staging.chunk_bytes))
        read = _staged_reader(path, size, metas, flat, staging, deadline)
    else:
        pieces = plan_pieces(metas, order, merged_spans(ranges, size, align=False), READ_PIECE)
        read = _direct_to_targets_reader(path, metas, flat)
    hasher = shared_pool("hash", max(1, os.cpu_count() or 1))
    hashes: list[tuple[str, str, cf.Future]] = []
    lock = threading.Lock()

    def on_tensor(name: str) -> None:
        if verify:
            future = hasher.submit(digest_of, flat[name])
            with lock:
                hashes.append((name, metas[name].checksum, future))

    reading = RegionReads(path, pieces, direct, fd, read, on_tensor)
    reading.run(threads, deadline, timeout_s, None, lambda: check_hashes(path, hashes, lock, deadline))


def stream_into(path: str, listed: ListedFile, targets: dict[str, torch.Tensor], staging: Staging, *, verify: bool = True,
                o_direct: bool | str = "auto", threads: int = 4, timeout_s: float = 1800.0) -> None:
    """Fill contiguous tensors on any device through ``staging``'s reused slots, in file order.

    For targets a read cannot land in (GPU memory), no host buffer the size of the file is
    allocated, let alone pinned: ``threads`` readers take the pieces in file order, each into a
    free slot, and copy its bytes to the targets; this thread walks the pieces in the same order,
    hashing each tensor's bytes on the slots (so its checksum streams), then frees the slot.
    Readers take a slot before their next piece, so the piece walked next always holds one:
    at least one slot suffices, ``threads`` + 1 keep every reader busy.
    """
    metas = listed.select(targets)
    flat = _byte_views(metas, targets, targets)
    if not flat:
        return
    order = list(flat)
    size = listed.file.size
    deadline = time.monotonic() + timeout_s
    fd, direct = open_for_read(path, o_direct)
    pieces = plan_pieces(metas, order, merged_spans([(metas[n].begin, metas[n].end) for n in order], size, align=direct),
                   min(READ_PIECE, staging.chunk_bytes))

    device = cuda_device_of(targets.values())
    # What the caller queued on its current streams (a non-default one included) that writes the
    # targets must land before the readers' copies, which run on the readers' own streams: they
    # wait for these points first, as the save's copy stream waits for its mark.
    marks = stream_marks(targets.values())

    def land(slot: int, piece: Piece) -> None:  # on the reader: copies of several pieces run in parallel
        bind_thread(device)  # a pool thread: the targets' GPU, never GPU 0 by default (device.py)
        for mark in marks:
            mark.wait()
        chunk = staging.view(slot)
        for name, lo, hi in piece.segments:
            begin = metas[name].begin
            # From a pinned slot to the device: a synchronous copy, done before the slot is reused.
            flat[name][lo - begin: hi - begin].copy_(chunk[lo - piece.off: hi - piece.off])

    streamed = _Streamed(path, size, pieces, staging, fd, deadline, land)
    hashers = {n: xxhash.xxh3_64() for n in order} if verify else {}
    try:
        if not direct:
            os.posix_fadvise(fd, pieces[0].off, pieces[-1].off + pieces[-1].length - pieces[0].off,
                             os.POSIX_FADV_SEQUENTIAL)
        streamed.start(threads)
        for index, piece in enumerate(pieces):  # checksums stream in file order, on this thread
            slot = streamed.wait(index)
            try:
                memory = staging.memory(slot, piece.length)
                for name, lo, hi in piece.segments:
                    if name not in hashers:
                        continue
                    hashers[name].update(memory[lo - piece.off: hi - piece.off])
                    if hi == metas[name].end and hashers[name].hexdigest() != metas[name].checksum:
                        raise CheckpointError(f"{path}: tensor {name!r} fails its checksum")
            finally:
                streamed.consumed(index)
        streamed.finish()
    except cf.TimeoutError:
        raise CheckpointError(f"reading {path} did not finish within {timeout_s:.0f}s (timeout)") from None
    except (OSError, CacheError) as exc:
        raise CheckpointError(f"reading {path} failed: {exc}") from exc
    finally:
        streamed.stop(timeout_s)
        os.close(fd)


class _Streamed:
    """``stream_into``'s readers: pieces taken in file order, each read into a slot of its own.

    A reader first takes a free slot, then the next piece (under one lock), so slots are held by
    pieces in file order and the lowest piece not yet consumed is always being read or ready.
    A failure on any thread stops the others and reaches the consumer.
    """

    def __init__(self, path: str, size: int, pieces: list[Piece], staging: Staging, fd: int, deadline: float,
                 land: Callable[[int, Piece], None]):
        self.path, self.size, self.pieces, self.staging, self.fd = path, size, pieces, staging, fd
        self.deadline, self.land = deadline, land
        self.cond = threading.Condition()
        self.take = threading.Lock()
        self.next = 0  # the next piece a reader takes
        self.slots: dict[int, int] = {}  # piece index -> its slot, once read
        self.held: set[int] = set()  # slots taken and not yet released
        self.error: BaseException | None = None
        self.futures: list[cf.Future] = []

    def start(self, threads: int) -> None:
        pool = shared_pool("read", threads)
        self.futures = [pool.submit(self._reader) for _ in range(min(threads, len(self.pieces)))]

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _reader(self) -> None:
        try:
            while True:
                with self.take:
                    if self.next == len(self.pieces) or self.error is not None:
                        return
                    slot = self.staging.acquire(max(0.0, self.deadline - time.monotonic()), self._check)
                    with self.cond:
                        self.held.add(slot)
                    index, self.next = self.next, self.next + 1
                piece = self.pieces[index]
                read_fully(self.fd, [self.staging.memory(slot, piece.length)], piece.off,
                            min(piece.length, self.size - piece.off), self.path)
                self.land(slot, piece)
                with self.cond:
                    self.slots[index] = slot
                    self.cond.notify_all()
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()
        self.staging.wake()  # a reader waiting for a slot gives up now

    def wait(self, index: int) -> int:
        """The slot holding piece ``index`` once read (raises the first failure, or times out)."""
        with self.cond:
            while index not in self.slots and self.error is None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise cf.TimeoutError()
                self.cond.wait(left)
            if index not in self.slots:
                raise self.error
            return self.slots[index]

    def consumed(self, index: int) -> None:
        with self.cond:
            slot = self.slots.pop(index)
            self.held.discard(slot)
        self.staging.release(slot)

    def finish(self) -> None:
        for future in self.futures:
            future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        self._check()

    def stop(self, timeout: float) -> None:
        """Stop the readers, wait for the running ones, and give back every slot they still hold."""
        self._fail(CheckpointError(f"reading {self.path} was abandoned"))
        cancel_and_wait(self.futures, timeout)
        with self.cond:
            held, self.held = list(self.held), set()
        for slot in held:
            self.staging.release(slot)


def _direct_to_targets_reader(path: str, metas: dict[str, TensorEntry],
                              flat: dict[str, torch.Tensor]) -> Callable[[int, Piece], None]:
    """Buffered reads: one ``preadv`` per piece scattering into the target tensors' memory
    (bytes between wanted tensors go to a scratch buffer)."""
    memory = {n: memoryview(t.numpy()) for n, t in flat.items()}
    scratch = threading.local()

    def gap(nbytes: int) -> memoryview:
        buf = getattr(scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = scratch.buf = memoryview(bytearray(max(nbytes, MERGE_GAP)))
        return buf[:nbytes]

    def read(fd: int, piece: Piece) -> None:
        buffers, at = [], piece.off
        for name, lo, hi in piece.segments:
            if lo > at:
                buffers.append(gap(lo - at))
            begin = metas[name].begin
            buffers.append(memory[name][lo - begin: hi - begin])
            at = hi
        end = piece.off + piece.length
        if end > at:
            buffers.append(gap(end - at))
        read_fully(fd, buffers, piece.off, piece.length, path)

    return read


def _staged_reader(path: str, size: int, metas: dict[str, TensorEntry], flat: dict[str, torch.Tensor], staging: Staging,
                   deadline: float) -> Callable[[int, Piece], None]:
    """O_DIRECT reads: each piece into an aligned staging slot, then copied into the target tensors."""

    def read(fd: int, piece: Piece) -> None:
        slot = staging.acquire(max(0.0, deadline - time.monotonic()))
        try:
            read_fully(fd, [staging.memory(slot, piece.length)], piece.off, min(piece.length, size - piece.off), path)
            chunk = staging.view(slot)
            for name, lo, hi in piece.segments:
                begin = metas[name].begin
                flat[name][lo - begin: hi - begin].copy_(chunk[lo - piece.off: hi - piece.off])
        finally:
            staging.release(slot)

    return read



_default_staging: dict[int, HostCache] = {}
_default_staging_lock = threading.Lock()


def default_staging(threads: int) -> HostCache:
    """Staging slots for readers without an engine's host cache: two per thread, kept for reuse."""
    with _default_staging_lock:
        if threads not in _default_staging:
            _default_staging[threads] = HostCache(2 * threads * READ_PIECE, READ_PIECE, pin=torch.cuda.is_available(),
                                                  device=rank_device())
        return _default_staging[threads]
