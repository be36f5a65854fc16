"""Fast reads of committed tensor files: several threads, each streaming one contiguous region.

Restore is bound by the disk, and one synchronous read at a time leaves it idle between
requests. The byte ranges of the wanted tensors (from the manifest: no header parsing, no
unpickling) are merged into spans and cut into pieces; the pieces are grouped into one contiguous
*region* per thread, and each thread reads its region front to back with ``preadv`` (the GIL is
released during the system call) on a file descriptor of its own. Two ways to read:

* **buffered** (``o_direct`` ``"auto"`` or ``False``): each thread advises
  ``POSIX_FADV_SEQUENTIAL`` on its descriptor, so the kernel reads ahead of it (a doubled window)
  while it copies the previous piece out of the page cache, and the bytes land directly in their
  destination (for ``read_into`` the caller's tensors: one copy in all, no alignment needed). On
  the virtual disk this was measured on, a cold read this way was faster than ``O_DIRECT`` with
  any number of threads in most rounds (up to 2.5x; docs/BENCHMARKS.md); without the advice,
  large buffered reads were 5-10x slower. Files still in the page cache are read at memory speed.
* **O_DIRECT** (``o_direct`` ``True``): no page cache; the pieces land in 4 KiB-aligned memory
  (one aligned buffer, or resident staging slots that are then copied into the caller's tensors).

Each tensor is checksummed on a second pool as soon as every piece it spans has arrived, so
hashing overlaps reading (xxhash's ``update`` releases the GIL above 64 KiB; its one-shot functions
never do, so they are not used on tensors).

GPU tensors cannot be read into: ``stream_into`` takes the pieces in file order through a few
reused (pinned) staging slots instead of one host buffer the size of the file.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import mmap
import os
import threading
import time
from typing import Any, Callable, Iterable, Protocol

import torch
import xxhash

from ..device import bind_thread, cuda_device_of, rank_device
from ..errors import CacheError, CheckpointError
from ..files import open_regular
from ..format.safetensors import ALIGN, round_up, torch_dtype
from ..host_cache import HostCache

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Bytes one thread reads per request: large enough to stream, small enough to spread over threads.
READ_PIECE = 8 << 20
#: Smaller staging slots than this cost more in requests than they save; a default pool is used instead.
MIN_STAGING_CHUNK = 1 << 20
#: Ranges closer than this are read as one (reading a small gap is cheaper than another request).
MERGE_GAP = 256 << 10
#: At most this many buffers per ``preadv`` call (Linux's IOV_MAX).
_IOV_MAX = 1024

_pools: dict[tuple[str, int], cf.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(kind: str, threads: int) -> cf.ThreadPoolExecutor:
    """One lazily created pool per kind and size, shared by every reader of the process."""
    with _pools_lock:
        pool = _pools.get((kind, threads))
        if pool is None:
            pool = _pools[(kind, threads)] = cf.ThreadPoolExecutor(threads, thread_name_prefix=f"datastates-{kind}")
        return pool


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` starting on a 4 KiB boundary (``O_DIRECT`` needs it)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip: skip + nbytes]


def open_for_read(path: str, o_direct: bool | str) -> tuple[int, bool]:
    """(fd, direct): ``O_DIRECT`` when ``o_direct`` is True (an error if refused), else buffered.

    ``"auto"`` reads buffered (see the module docstring for why). Only a regular file is opened,
    never through a symbolic link (a checkpoint's files are its own). The ``O_DIRECT`` probe is
    one aligned 4 KiB read of the file's first block (every tensor file has one: the header is
    padded to 4 KiB), so nothing is written next to the checkpoint.
    """
    fd = open_regular(path)
    if o_direct is not True:
        return fd, False
    refused = f"o_direct is true but {os.path.dirname(path)} refuses O_DIRECT reads"
    try:
        if not _O_DIRECT:
            raise CheckpointError("o_direct is true but this platform has no O_DIRECT")
        try:
            direct = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | _O_DIRECT)
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


def _spans(ranges: list[tuple[int, int]], size: int, align: bool = True) -> list[tuple[int, int]]:
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
class _Piece:
    """One read request: file bytes [off, off + length) and the tensor bytes it carries."""

    off: int
    length: int  # may run past the end of the file (O_DIRECT reads whole blocks); reads stop there
    segments: list[tuple[str, int, int]]  # (tensor, file lo, file hi) within the piece
    buf_off: int = 0  # where the piece lands in a single buffer (``read_tensors``)
    done: bool = False


def _plan(metas: dict[str, dict], order: list[str], spans: list[tuple[int, int]], step: int) -> list[_Piece]:
    """Cut ``spans`` into pieces of at most ``step`` bytes, each knowing the tensors it carries."""
    pieces: list[_Piece] = []
    i = 0
    packed = 0  # bytes of the spans before this piece: its place in a single buffer
    for lo_span, hi_span in spans:
        for off in range(lo_span, hi_span, step):
            end = min(off + step, hi_span)
            while i < len(order) and metas[order[i]]["offsets"][1] <= off:
                i += 1
            segments = []
            j = i
            while j < len(order) and metas[order[j]]["offsets"][0] < end:
                b, e = metas[order[j]]["offsets"]
                if e > off:
                    segments.append((order[j], max(b, off), min(e, end)))
                j += 1
            pieces.append(_Piece(off, end - off, segments, packed + off - lo_span))
        packed += hi_span - lo_span
    return pieces


def _regions(pieces: list[_Piece], count: int) -> list[list[_Piece]]:
    """``pieces`` (in file order) as at most ``count`` contiguous groups of about equal bytes."""
    total = sum(p.length for p in pieces)
    groups: list[list[_Piece]] = [[]]
    filled = 0
    for piece in pieces:
        if groups[-1] and filled >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(piece)
        filled += piece.length
    return groups


def _read_fully(fd: int, buffers: list[memoryview], off: int, want: int, path: str) -> None:
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


class _Reading:
    """One call's pieces read region by region on a thread pool; says when each tensor is complete.

    ``read(fd, piece)`` reads one piece; ``on_tensor(name)`` runs (on a reading thread) once every
    piece carrying a tensor has been read. A failure on any thread stops the others at their next
    piece and wakes every waiter.
    """

    def __init__(self, path: str, pieces: list[_Piece], direct: bool, first_fd: int,
                 read: Callable[[int, _Piece], None], on_tensor: Callable[[str], None]):
        self.path, self.pieces, self.direct = path, pieces, direct
        self.read, self.on_tensor = read, on_tensor
        self.remaining: dict[str, int] = {}
        for piece in pieces:
            for name, _, _ in piece.segments:
                self.remaining[name] = self.remaining.get(name, 0) + 1
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.fds = [first_fd]
        self.futures: list[cf.Future] = []

    def start(self, pool: cf.ThreadPoolExecutor, threads: int) -> None:
        for i, region in enumerate(_regions(self.pieces, threads)):
            if i:
                self.fds.append(self._reopen())
            self.futures.append(pool.submit(self._region, self.fds[i], region))

    def _reopen(self) -> int:
        """Another descriptor (its own read-ahead) of the very file the first one has open."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | (_O_DIRECT if self.direct else 0))
        first, other = os.fstat(self.fds[0]), os.fstat(fd)
        if (first.st_dev, first.st_ino) != (other.st_dev, other.st_ino):
            os.close(fd)
            raise CheckpointError(f"{self.path}: replaced while it was being read")
        return fd

    def _region(self, fd: int, region: list[_Piece]) -> None:
        try:
            if not self.direct and region:
                os.posix_fadvise(fd, region[0].off, region[-1].off + region[-1].length - region[0].off,
                                 os.POSIX_FADV_SEQUENTIAL)
            for piece in region:
                if self.error is not None:
                    return
                self.read(fd, piece)
                complete = []
                with self.cond:
                    piece.done = True
                    for name, _, _ in piece.segments:
                        self.remaining[name] -= 1
                        if not self.remaining[name]:
                            complete.append(name)
                    self.cond.notify_all()
                for name in complete:
                    self.on_tensor(name)
        except BaseException as exc:
            with self.cond:
                if self.error is None:
                    self.error = exc
                self.cond.notify_all()
            raise

    def wait_piece(self, piece: _Piece, deadline: float) -> None:
        """Block until ``piece`` is read (raises the first failure of any thread, or times out)."""
        with self.cond:
            while not piece.done and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise cf.TimeoutError()
                self.cond.wait(left)
        if not piece.done:
            raise self.error

    def finish(self, deadline: float) -> None:
        """Wait for every region; the first failure is raised."""
        for future in self.futures:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise self.error

    def run(self, threads: int, deadline: float, timeout_s: float, while_reading: Callable[[], None] | None,
            after: Callable[[], None]) -> None:
        """Read everything (``while_reading`` runs meanwhile on this thread), then ``after``; errors name the file."""
        try:
            self.start(_pool("read", threads), threads)
            if while_reading is not None:
                while_reading()
            self.finish(deadline)
            after()
        except CheckpointError:
            self.abandon(timeout_s)
            raise
        except cf.TimeoutError:
            self.abandon(timeout_s)
            raise CheckpointError(f"reading {self.path} did not finish within {timeout_s:.0f}s (timeout)") from None
        except (OSError, CacheError) as exc:
            self.abandon(timeout_s)
            raise CheckpointError(f"reading {self.path} failed: {exc}") from exc
        except BaseException:
            self.abandon(timeout_s)
            raise
        finally:
            for fd in self.fds:
                os.close(fd)
            self.fds = []

    def abandon(self, timeout: float) -> None:
        """After a failure: stop the regions and wait for the running ones (they use the fds and buffers)."""
        with self.cond:
            if self.error is None:
                self.error = CheckpointError(f"reading {self.path} was abandoned")
            self.cond.notify_all()
        _cancel(self.futures, timeout)


def _metas(entry: dict, names: Iterable[str]) -> dict[str, dict]:
    metas: dict[str, dict] = {}
    for name in names:
        meta = entry["tensors"].get(name)
        if meta is None:
            raise CheckpointError(f"{entry['tensor_file']} lacks tensor {name!r}")
        metas[name] = meta
    return metas


def read_tensors(path: str, entry: dict, names: Iterable[str], *, verify: bool = True, whole_file: bool = False,
                 o_direct: bool | str = "auto", threads: int = 4, pin: bool = False,
                 timeout_s: float = 1800.0) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of one committed file (``entry`` = its manifest entry), read in parallel.

    With ``whole_file`` the whole file is read and, if ``verify``, its xxh3-64 compared with the
    manifest as well; otherwise only the wanted ranges are read. Each tensor's own checksum is
    always compared when ``verify``. The tensors share one aligned (pinned if ``pin``) buffer.
    """
    metas = _metas(entry, names)
    order = sorted(metas, key=lambda n: metas[n]["offsets"][0])
    size = entry["size"]
    sized = [n for n in order if metas[n]["offsets"][1] > metas[n]["offsets"][0]]
    if whole_file:
        spans = [(0, round_up(size))]
    else:
        spans = _spans([tuple(metas[n]["offsets"]) for n in sized], size) if sized else []
    pieces = _plan(metas, sized, spans, READ_PIECE)
    buf = aligned_buffer(sum(hi - lo for lo, hi in spans), pin)
    memory = memoryview(buf.numpy())
    place = {}  # tensor -> its offset in the buffer
    for piece in pieces:
        for name, lo, _ in piece.segments:
            place.setdefault(name, piece.buf_off + lo - piece.off)
    out: dict[str, torch.Tensor] = {}
    for name in order:
        begin, end = metas[name]["offsets"]
        dtype = torch_dtype(metas[name]["dtype"])
        if end == begin:
            out[name] = torch.empty(metas[name]["shape"], dtype=dtype)
            continue
        # Its own storage (offset 0) over the buffer's bytes: set_rng_state, torch.save and friends
        # treat it like any tensor; the buffer lives as long as any of its tensors.
        view = torch.frombuffer(memory, dtype=torch.uint8, count=end - begin, offset=place[name])
        out[name] = view.view(dtype).view(metas[name]["shape"])
    if not pieces:
        return out

    hasher = _pool("hash", max(1, os.cpu_count() or 1))
    hashes: list[tuple[str, str, cf.Future]] = []
    lock = threading.Lock()

    def on_tensor(name: str) -> None:
        expected = metas[name].get("xxh3_64")
        if verify and expected is not None:
            future = hasher.submit(_digest, out[name].reshape(-1).view(torch.uint8))
            with lock:
                hashes.append((name, expected, future))

    def read(fd: int, piece: _Piece) -> None:
        _read_fully(fd, [memory[piece.buf_off: piece.buf_off + piece.length]], piece.off,
                    min(piece.length, size - piece.off), path)

    deadline = time.monotonic() + timeout_s
    fd, direct = open_for_read(path, o_direct)
    reading = _Reading(path, pieces, direct, fd, read, on_tensor)

    whole = xxhash.xxh3_64() if verify and whole_file else None

    def whole_file_checksum() -> None:
        for piece in pieces:  # in file order, while later pieces are still being read
            reading.wait_piece(piece, deadline)
            whole.update(memory[piece.buf_off: piece.buf_off + max(0, min(piece.length, size - piece.off))])

    def check() -> None:  # a damaged tensor is named before the file's checksum is blamed
        _check_hashes(path, hashes, lock, deadline)
        if whole is not None and whole.hexdigest() != entry["xxh3_64"]:
            raise CheckpointError(f"{path} fails its checksum")

    reading.run(threads, deadline, timeout_s, whole_file_checksum if whole is not None else None, check)
    return out


def _check_hashes(path: str, hashes: list, lock: threading.Lock, deadline: float) -> None:
    with lock:
        pending = list(hashes)
    for name, expected, future in pending:
        if future.result(timeout=max(0.0, deadline - time.monotonic())) != expected:
            raise CheckpointError(f"{path}: tensor {name!r} fails its checksum")


class Staging(Protocol):
    """Aligned, resident chunk slots (the engine's ``HostCache``): O_DIRECT reads land here, then go to tensors."""

    chunk_bytes: int

    num_slots: int

    def acquire(self, timeout: float, check: Callable[[], None] = ...) -> int: ...
    def release(self, slot: int) -> None: ...
    def wake(self) -> None: ...
    def view(self, slot: int) -> torch.Tensor: ...
    def memory(self, slot: int, nbytes: int) -> memoryview: ...


def _byte_views(metas: dict[str, dict], targets: dict[str, torch.Tensor],
                names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Byte views of the targets ``names`` that hold bytes in the file, in file order (filled in place)."""
    order = sorted((n for n in names if metas[n]["offsets"][1] > metas[n]["offsets"][0]),
                   key=lambda n: metas[n]["offsets"][0])
    return {n: targets[n].detach().reshape(-1).view(torch.uint8) for n in order}


def read_into(path: str, entry: dict, targets: dict[str, torch.Tensor], staging: Staging, *, verify: bool = True,
              o_direct: bool | str = "auto", threads: int = 4, timeout_s: float = 1800.0) -> None:
    """Fill existing tensors (e.g. a model's) with their saved bytes; checksums from the filled tensors.

    The memory of freshly allocated tensors must be faulted in page by page, which on some
    machines costs more than the disk read itself; reading into tensors that already exist avoids
    it. Buffered reads land in host tensors directly; O_DIRECT reads land in ``staging``'s aligned
    slots first and are copied from there. Device tensors are filled through the slots by
    ``stream_into``; strided ones (rare) from a fresh host buffer of their own.
    """
    metas = _metas(entry, targets)
    for name, target in targets.items():
        meta = metas[name]
        if torch_dtype(meta["dtype"]) != target.dtype or list(meta["shape"]) != list(target.shape):
            raise CheckpointError(f"{path}: tensor {name!r} is {meta['dtype']}{meta['shape']} in the checkpoint, "
                                  f"the target is {target.dtype}{list(target.shape)}: the template is not the model "
                                  "that was saved (load() returns the state as saved)")
    strided = {n: t for n, t in targets.items() if not t.is_contiguous()}
    device = {n: t for n, t in targets.items() if n not in strided and t.device.type != "cpu"}
    if strided:  # rare: a fresh host buffer of just these tensors (pinned on a GPU node), then copies
        fresh = read_tensors(path, entry, list(strided), verify=verify, o_direct=o_direct, threads=threads,
                             pin=torch.cuda.is_available(), timeout_s=timeout_s)
        for name, target in strided.items():
            target.copy_(fresh[name])
    if device:
        stream_into(path, entry, device, staging, verify=verify, o_direct=o_direct, threads=threads,
                    timeout_s=timeout_s)
    flat = _byte_views(metas, targets, [n for n in targets if n not in strided and n not in device])
    if not flat:
        return
    order = list(flat)
    size = entry["size"]
    deadline = time.monotonic() + timeout_s
    fd, direct = open_for_read(path, o_direct)
    ranges = [tuple(metas[n]["offsets"]) for n in order]
    if direct:
        pieces = _plan(metas, order, _spans(ranges, size), min(READ_PIECE, staging.chunk_bytes))
        read = _staged_reader(path, size, metas, flat, staging, deadline)
    else:
        pieces = _plan(metas, order, _spans(ranges, size, align=False), READ_PIECE)
        read = _direct_to_targets_reader(path, metas, flat)
    hasher = _pool("hash", max(1, os.cpu_count() or 1))
    hashes: list[tuple[str, str, cf.Future]] = []
    lock = threading.Lock()

    def on_tensor(name: str) -> None:
        expected = metas[name].get("xxh3_64")
        if verify and expected is not None:
            future = hasher.submit(_digest, flat[name])
            with lock:
                hashes.append((name, expected, future))

    reading = _Reading(path, pieces, direct, fd, read, on_tensor)
    reading.run(threads, deadline, timeout_s, None, lambda: _check_hashes(path, hashes, lock, deadline))


def stream_into(path: str, entry: dict, targets: dict[str, torch.Tensor], staging: Staging, *, verify: bool = True,
                o_direct: bool | str = "auto", threads: int = 4, timeout_s: float = 1800.0) -> None:
    """Fill contiguous tensors on any device through ``staging``'s reused slots, in file order.

    For targets a read cannot land in (GPU memory), no host buffer the size of the file is
    allocated, let alone pinned: ``threads`` readers take the pieces in file order, each into a
    free slot, and copy its bytes to the targets; this thread walks the pieces in the same order,
    hashing each tensor's bytes on the slots (so its checksum streams), then frees the slot.
    Readers take a slot before their next piece, so the piece walked next always holds one:
    at least one slot suffices, ``threads`` + 1 keep every reader busy.
    """
    metas = _metas(entry, targets)
    flat = _byte_views(metas, targets, targets)
    if not flat:
        return
    order = list(flat)
    size = entry["size"]
    deadline = time.monotonic() + timeout_s
    fd, direct = open_for_read(path, o_direct)
    pieces = _plan(metas, order, _spans([tuple(metas[n]["offsets"]) for n in order], size, align=direct),
                   min(READ_PIECE, staging.chunk_bytes))

    device = cuda_device_of(targets.values())

    def land(slot: int, piece: _Piece) -> None:  # on the reader: copies of several pieces run in parallel
        bind_thread(device)  # a pool thread: the targets' GPU, never GPU 0 by default (device.py)
        chunk = staging.view(slot)
        for name, lo, hi in piece.segments:
            begin = metas[name]["offsets"][0]
            # From a pinned slot to the device: a synchronous copy, done before the slot is reused.
            flat[name][lo - begin: hi - begin].copy_(chunk[lo - piece.off: hi - piece.off])

    streamed = _Streamed(path, size, pieces, staging, fd, deadline, land)
    hashers = {n: xxhash.xxh3_64() for n in order if verify and metas[n].get("xxh3_64") is not None}
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
                    if hi == metas[name]["offsets"][1] and hashers[name].hexdigest() != metas[name]["xxh3_64"]:
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

    def __init__(self, path: str, size: int, pieces: list[_Piece], staging: Staging, fd: int, deadline: float,
                 land: Callable[[int, _Piece], None]):
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
        pool = _pool("read", threads)
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
                _read_fully(self.fd, [self.staging.memory(slot, piece.length)], piece.off,
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
        _cancel(self.futures, timeout)
        with self.cond:
            held, self.held = list(self.held), set()
        for slot in held:
            self.staging.release(slot)


def _direct_to_targets_reader(path: str, metas: dict[str, dict],
                              flat: dict[str, torch.Tensor]) -> Callable[[int, _Piece], None]:
    """Buffered reads: one ``preadv`` per piece scattering into the target tensors' memory
    (bytes between wanted tensors go to a scratch buffer)."""
    memory = {n: memoryview(t.numpy()) for n, t in flat.items()}
    scratch = threading.local()

    def gap(nbytes: int) -> memoryview:
        buf = getattr(scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = scratch.buf = memoryview(bytearray(max(nbytes, MERGE_GAP)))
        return buf[:nbytes]

    def read(fd: int, piece: _Piece) -> None:
        buffers, at = [], piece.off
        for name, lo, hi in piece.segments:
            if lo > at:
                buffers.append(gap(lo - at))
            begin = metas[name]["offsets"][0]
            buffers.append(memory[name][lo - begin: hi - begin])
            at = hi
        end = piece.off + piece.length
        if end > at:
            buffers.append(gap(end - at))
        _read_fully(fd, buffers, piece.off, piece.length, path)

    return read


def _staged_reader(path: str, size: int, metas: dict[str, dict], flat: dict[str, torch.Tensor], staging: Staging,
                   deadline: float) -> Callable[[int, _Piece], None]:
    """O_DIRECT reads: each piece into an aligned staging slot, then copied into the target tensors."""

    def read(fd: int, piece: _Piece) -> None:
        slot = staging.acquire(max(0.0, deadline - time.monotonic()))
        try:
            _read_fully(fd, [staging.memory(slot, piece.length)], piece.off, min(piece.length, size - piece.off), path)
            chunk = staging.view(slot)
            for name, lo, hi in piece.segments:
                begin = metas[name]["offsets"][0]
                flat[name][lo - begin: hi - begin].copy_(chunk[lo - piece.off: hi - piece.off])
        finally:
            staging.release(slot)

    return read


_default_staging: dict[int, HostCache] = {}


def default_staging(threads: int) -> HostCache:
    """Staging slots for readers without an engine's host cache: two per thread, kept for reuse."""
    with _pools_lock:
        if threads not in _default_staging:
            _default_staging[threads] = HostCache(2 * threads * READ_PIECE, READ_PIECE, pin=torch.cuda.is_available(),
                                                  device=rank_device())
        return _default_staging[threads]


def _cancel(futures: list[cf.Future], timeout: float) -> None:
    """After a failure: cancel what has not started, wait for what has (it uses the file and buffers)."""
    for future in futures:
        future.cancel()
    cf.wait(futures, timeout=timeout)


def _digest(view: torch.Tensor) -> str:
    # ``update`` releases the GIL above 64 KiB; the one-shot ``xxh3_64_hexdigest`` never does, which
    # would serialise the hashing pool with the reading threads and the caller.
    digest = xxhash.xxh3_64()
    digest.update(memoryview(view.numpy()))
    return digest.hexdigest()


def to_device(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    """Apply ``torch.load``-style ``map_location``; host-to-GPU copies from pinned memory run async."""
    moved = {k: _map(v, map_location) for k, v in tensors.items()}
    if any(t.is_cuda for t in moved.values()):
        torch.cuda.current_stream().synchronize()  # callers get finished tensors, as from torch.load
    return moved


def _map(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    if callable(map_location):
        return map_location(tensor, "cpu")
    target = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
    return tensor.to(target, non_blocking=tensor.is_pinned())
