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
  any number of threads in most rounds (2.2-3.2 GB/s against 1-1.6 GB/s; docs/BENCHMARKS.md, "bench restore"); without the advice,
  large buffered reads were 5-10x slower. Files still in the page cache are read at memory speed.
* **O_DIRECT** (``o_direct`` ``True``): no page cache; the pieces land in 4 KiB-aligned memory
  (one aligned buffer, or resident staging slots that are then copied into the caller's tensors).

Each tensor is checksummed on a second pool as soon as every piece it spans has arrived, so
hashing overlaps reading (xxhash's ``update`` releases the GIL above 64 KiB; its one-shot functions
never do, so they are not used on tensors).

This module reads the planned pieces (``read_plan``) region by region (``RegionReads``) and
returns the tensors of one file in one fresh aligned buffer (``read_tensors``); filling tensors
that already exist, through staging slots where needed, is ``staged_read``'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from typing import Any, Callable, Iterable

import torch
import xxhash

from ..device import cuda_devices_of
from ..errors import CacheError, CheckpointError
from ..files import round_up
from ..format.digest import tensor_file_digest
from ..format.entries import ListedFile
from .read_plan import (
    O_DIRECT_FLAG,
    READ_PIECE,
    Piece,
    aligned_buffer,
    cancel_and_wait,
    digest_of,
    merged_spans,
    open_for_read,
    plan_pieces,
    read_fully,
    shared_pool,
)


def _regions(pieces: list[Piece], count: int) -> list[list[Piece]]:
    """``pieces`` (in file order) as at most ``count`` contiguous groups of about equal bytes."""
    total = sum(p.length for p in pieces)
    groups: list[list[Piece]] = [[]]
    filled = 0
    for piece in pieces:
        if groups[-1] and filled >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(piece)
        filled += piece.length
    return groups


class RegionReads:
    """One call's pieces read region by region on a thread pool; says when each tensor is complete.

    ``read(fd, piece)`` reads one piece; ``on_tensor(name)`` runs (on a reading thread) once every
    piece carrying a tensor has been read. A failure on any thread stops the others at their next
    piece and wakes every waiter.
    """

    def __init__(self, path: str, pieces: list[Piece], direct: bool, first_fd: int,
                 read: Callable[[int, Piece], None], on_tensor: Callable[[str], None]):
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
                     | (O_DIRECT_FLAG if self.direct else 0))
        first, other = os.fstat(self.fds[0]), os.fstat(fd)
        if (first.st_dev, first.st_ino) != (other.st_dev, other.st_ino):
            os.close(fd)
            raise CheckpointError(f"{self.path}: replaced while it was being read")
        return fd

    def _region(self, fd: int, region: list[Piece]) -> None:
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

    def wait_piece(self, piece: Piece, deadline: float) -> None:
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
            self.start(shared_pool("read", threads), threads)
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
        cancel_and_wait(self.futures, timeout)


def read_tensors(path: str, listed: ListedFile, names: Iterable[str], *, verify: bool = True, whole_file: bool = False,
                 piecewise: bool = True, o_direct: bool | str = "auto", threads: int = 4, pin: bool = False,
                 timeout_s: float = 1800.0) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of one committed file (``listed``: its entry and tensors), read in parallel.

    With ``whole_file`` the whole file is read and, if ``verify``, its xxh3-64 compared with the
    manifest as well (``piecewise``, format 3: made of its header's and its tensors' digests, so
    only the header takes a pass of its own; else of all its bytes); otherwise only the wanted
    ranges are read. Each tensor's own checksum is always compared when ``verify``. The tensors
    share one aligned (pinned if ``pin``) buffer.
    """
    metas = listed.select(names)
    order = sorted(metas, key=lambda n: metas[n].begin)
    size = listed.file.size
    sized = [n for n in order if metas[n].end > metas[n].begin]
    if whole_file:
        spans = [(0, round_up(size))]
    else:
        spans = merged_spans([(metas[n].begin, metas[n].end) for n in sized], size) if sized else []
    pieces = plan_pieces(metas, sized, spans, READ_PIECE)
    buf = aligned_buffer(sum(hi - lo for lo, hi in spans), pin)
    memory = memoryview(buf.numpy())
    place = {}  # tensor -> its offset in the buffer
    for piece in pieces:
        for name, lo, _ in piece.segments:
            place.setdefault(name, piece.buf_off + lo - piece.off)
    out: dict[str, torch.Tensor] = {}
    for name in order:
        meta = metas[name]
        begin, end, dtype = meta.begin, meta.end, meta.dtype
        if end == begin:
            out[name] = torch.empty(meta.shape, dtype=dtype)
            continue
        # Its own storage (offset 0) over the buffer's bytes: set_rng_state, torch.save and friends
        # treat it like any tensor; the buffer lives as long as any of its tensors.
        view = torch.frombuffer(memory, dtype=torch.uint8, count=end - begin, offset=place[name])
        out[name] = view.view(dtype).view(meta.shape)
    if not pieces:
        return out

    hasher = shared_pool("hash", max(1, os.cpu_count() or 1))
    hashes: list[tuple[str, str, cf.Future]] = []
    lock = threading.Lock()

    def on_tensor(name: str) -> None:
        if verify:
            future = hasher.submit(digest_of, out[name].reshape(-1).view(torch.uint8))
            with lock:
                hashes.append((name, metas[name].checksum, future))

    def read(fd: int, piece: Piece) -> None:
        read_fully(fd, [memory[piece.buf_off: piece.buf_off + piece.length]], piece.off,
                    min(piece.length, size - piece.off), path)

    deadline = time.monotonic() + timeout_s
    fd, direct = open_for_read(path, o_direct)
    reading = RegionReads(path, pieces, direct, fd, read, on_tensor)

    whole = xxhash.xxh3_64() if verify and whole_file and not piecewise else None

    def whole_file_checksum() -> None:
        for piece in pieces:  # in file order, while later pieces are still being read
            reading.wait_piece(piece, deadline)
            whole.update(memory[piece.buf_off: piece.buf_off + max(0, min(piece.length, size - piece.off))])

    def check() -> None:  # a damaged tensor is named before the file's checksum is blamed
        check_hashes(path, hashes, lock, deadline)
        if not (verify and whole_file):
            return
        if piecewise:  # the buffer starts at the file's start: the header is before the first tensor's bytes
            data_start = min((metas[n].begin for n in sized), default=size)
            tensors = ((t.begin, t.end, t.checksum) for t in listed.tensors.values())
            found = tensor_file_digest(xxhash.xxh3_64_intdigest(memory[:data_start]), tensors)
        else:
            found = whole.hexdigest()
        if found != listed.file.checksum:
            raise CheckpointError(f"{path} fails its checksum")

    reading.run(threads, deadline, timeout_s, whole_file_checksum if whole is not None else None, check)
    return out


def check_hashes(path: str, hashes: list, lock: threading.Lock, deadline: float) -> None:
    with lock:
        pending = list(hashes)
    for name, expected, future in pending:
        if future.result(timeout=max(0.0, deadline - time.monotonic())) != expected:
            raise CheckpointError(f"{path}: tensor {name!r} fails its checksum")


def to_device(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    """Apply ``torch.load``-style ``map_location``; host-to-GPU copies from pinned memory run async.

    Each copy is queued on the current stream of its *target* device (not the calling thread's
    current device: ``map_location`` may name another GPU), so every such stream is synchronised:
    callers get finished tensors, as from ``torch.load``.
    """
    moved = {k: _map(v, map_location) for k, v in tensors.items()}
    for device in cuda_devices_of(moved.values()):
        _synchronize(device)
    return moved


def _synchronize(device: int) -> None:
    """Wait for what the calling thread queued on ``device``'s current stream (a seam for the CPU tests)."""
    torch.cuda.current_stream(device).synchronize()


def _map(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    if callable(map_location):
        return map_location(tensor, "cpu")
    target = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
    return tensor.to(target, non_blocking=tensor.is_pinned())
