"""Fast reads of committed tensor files: several threads, ``O_DIRECT`` into 4 KiB-aligned host memory.

Restore is bound by the disk, and one synchronous read at a time leaves it idle between
requests. Here the byte ranges of the wanted tensors are widened to 4 KiB boundaries, neighbours
merged, and the merged spans cut into pieces that a pool of threads reads with ``preadv`` (the GIL
is released during the system call) into one aligned buffer, with ``O_DIRECT`` where the file
system allows it (no page-cache copy, and a cold read by construction). Each tensor is then a
view of that buffer (with a storage of its own): no second copy on the host, no header parsing, no unpickling; dtype, shape
and offsets come from the manifest, which a committed checkpoint already made trustworthy.

Checksums are computed on a second pool as soon as all the pieces a tensor spans have arrived, so
hashing overlaps reading (xxhash releases the GIL; two threads hash ~1.8x faster than one here).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import errno
import mmap
import os
import stat
import threading
import time
from typing import Any, Iterable, Protocol

import torch
import xxhash

from .host_cache import CacheError, HostCache
from .jobs import CheckpointError
from .layout import ALIGN, round_up, torch_dtype

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Bytes one thread reads per request: large enough to stream, small enough to spread over threads.
READ_PIECE = 8 << 20
#: Smaller staging slots than this cost more in requests than they save; a default pool is used instead.
MIN_STAGING_CHUNK = 1 << 20
#: Ranges closer than this are read as one (reading a small gap is cheaper than another request).
MERGE_GAP = 256 << 10

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
    """(fd, direct): ``O_DIRECT`` when allowed and the file system takes it, else buffered.

    Only a regular file is opened, never through a symbolic link (a checkpoint's files are its
    own). The ``O_DIRECT`` probe is one aligned 4 KiB read of the file's first block (every tensor
    file has one: the header is padded to 4 KiB), so nothing is written next to the checkpoint.
    """
    fd = open_regular(path)
    if o_direct is not False and _O_DIRECT:
        try:
            direct = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | _O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                os.close(fd)
                raise CheckpointError(f"checkpoint file {path} cannot be opened: {exc.strerror or exc}") from None
        else:
            probe = mmap.mmap(-1, ALIGN)
            try:
                if os.fstat(direct).st_ino == os.fstat(fd).st_ino:  # the same regular file
                    os.preadv(direct, [probe], 0)
                    os.close(fd)
                    return direct, True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(fd)
                    os.close(direct)
                    raise CheckpointError(f"reading {path} failed: {exc.strerror or exc}") from None
            finally:
                probe.close()
            os.close(direct)
        if o_direct is True:
            os.close(fd)
            raise CheckpointError(f"o_direct is true but {os.path.dirname(path)} refuses O_DIRECT reads")
    return fd, False


def open_regular(path: str) -> int:
    """A read-only fd of the regular file ``path`` (not a link, FIFO or device), else CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a symbolic link (a checkpoint's files must be its own)") from None
        raise CheckpointError(f"{path}: cannot be opened: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def _spans(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Aligned [start, end) spans covering ``ranges`` (non-empty, sorted), merged when close."""
    spans: list[list[int]] = []
    for begin, end in ranges:
        lo, hi = begin // ALIGN * ALIGN, min(round_up(end), round_up(size))
        if spans and lo <= spans[-1][1] + MERGE_GAP:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(lo, hi) for lo, hi in spans]


class _Pieces:
    """The read requests of one call: each piece lands at its place in the buffer."""

    def __init__(self, path: str, fd: int, buf: torch.Tensor, size: int):
        self.path, self.fd, self.size = path, fd, size
        self.memory = memoryview(buf.numpy())
        self.starts: list[int] = []  # file offset of each piece, ascending
        self.futures: list[cf.Future] = []
        self.waited = 0  # pieces known to be complete

    def read(self, file_off: int, buf_off: int, length: int) -> None:
        """Read until ``length`` bytes or the end of the file, which must be at ``self.size``."""
        want = min(length, self.size - file_off)
        got = 0
        while got < want:
            n = os.preadv(self.fd, [self.memory[buf_off + got: buf_off + length]], file_off + got)
            if n == 0:
                raise CheckpointError(f"{self.path} is truncated (ends before byte {file_off + want})")
            got += n

    def submit(self, pool: cf.ThreadPoolExecutor, span: tuple[int, int], buf_off: int) -> None:
        for off in range(span[0], span[1], READ_PIECE):
            length = min(READ_PIECE, span[1] - off)
            self.starts.append(off)
            self.futures.append(pool.submit(self.read, off, buf_off + off - span[0], length))

    def wait_until(self, file_end: int, deadline: float) -> None:
        """Block until every piece starting before ``file_end`` is in the buffer (calls ascend)."""
        while self.waited < len(self.futures) and self.starts[self.waited] < file_end:
            self.futures[self.waited].result(timeout=max(0.0, deadline - time.monotonic()))
            self.waited += 1

    def abandon(self, timeout: float) -> None:
        _cancel(self.futures, timeout)


def read_tensors(path: str, entry: dict, names: Iterable[str], *, verify: bool = True, whole_file: bool = False,
                 o_direct: bool | str = "auto", threads: int = 4, pin: bool = False,
                 timeout_s: float = 1800.0) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of one committed file (``entry`` = its manifest entry), read in parallel.

    With ``whole_file`` the whole file is read and, if ``verify``, its xxh3-64 compared with the
    manifest as well; otherwise only the wanted ranges are read. Each tensor's own checksum is
    always compared when ``verify``. The tensors share one aligned (pinned if ``pin``) buffer.
    """
    metas: dict[str, dict] = {}
    for name in names:
        meta = entry["tensors"].get(name)
        if meta is None:
            raise CheckpointError(f"{entry['tensor_file']} lacks tensor {name!r}")
        metas[name] = meta
    order = sorted(metas, key=lambda n: metas[n]["offsets"][0])
    size = entry["size"]
    wanted = [tuple(metas[n]["offsets"]) for n in order if metas[n]["offsets"][1] > metas[n]["offsets"][0]]
    if whole_file:
        spans = [(0, round_up(size))]
    else:
        spans = _spans(wanted, size) if wanted else []
    places: list[tuple[int, int]] = []  # (file start, buffer start) of each span
    total = 0
    for lo, hi in spans:
        places.append((lo, total))
        total += hi - lo
    span_starts = [lo for lo, _ in places]
    buf = aligned_buffer(total, pin)
    deadline = time.monotonic() + timeout_s
    fd = open_for_read(path, o_direct)[0] if spans else -1
    pieces = _Pieces(path, fd, buf, size)
    try:
        reads = _pool("read", threads)
        for span, (_, buf_off) in zip(spans, places):
            pieces.submit(reads, span, buf_off)
        out: dict[str, torch.Tensor] = {}
        hashes: list[tuple[str, str, cf.Future]] = []
        hasher = _pool("hash", max(1, os.cpu_count() or 1))
        whole = xxhash.xxh3_64() if verify and whole_file else None
        hashed_to = 0  # file bytes fed to ``whole`` so far
        for name in order:
            meta = metas[name]
            begin, end = meta["offsets"]
            dtype = torch_dtype(meta["dtype"])
            if end == begin:
                out[name] = torch.empty(meta["shape"], dtype=dtype)
                continue
            lo, buf_off = places[bisect.bisect_right(span_starts, begin) - 1]
            # Its own storage (offset 0) over the buffer's bytes: set_rng_state, torch.save and
            # friends treat it like any tensor; the buffer lives as long as any of its tensors.
            view = torch.frombuffer(pieces.memory, dtype=torch.uint8, count=end - begin, offset=buf_off + begin - lo)
            out[name] = view.view(dtype).view(meta["shape"])
            pieces.wait_until(end, deadline)
            if whole is not None:
                whole.update(pieces.memory[hashed_to:end])
                hashed_to = end
            expected = meta.get("xxh3_64")
            if verify and expected is not None:
                hashes.append((name, expected, hasher.submit(_digest, view)))
        if whole is not None:
            pieces.wait_until(size, deadline)
            whole.update(pieces.memory[hashed_to:size])
        for name, expected, future in hashes:
            if future.result(timeout=max(0.0, deadline - time.monotonic())) != expected:
                raise CheckpointError(f"{path}: tensor {name!r} fails its checksum")
        if whole is not None and whole.hexdigest() != entry["xxh3_64"]:
            raise CheckpointError(f"{path} fails its checksum")
        pieces.wait_until(size + 1, deadline)  # the gaps read along with the tensors, before closing
    except cf.TimeoutError:
        pieces.abandon(timeout_s)
        raise CheckpointError(f"reading {path} did not finish within {timeout_s:.0f}s (timeout)") from None
    except CheckpointError:
        pieces.abandon(timeout_s)
        raise
    except OSError as exc:
        pieces.abandon(timeout_s)
        raise CheckpointError(f"reading {path} failed: {exc}") from exc
    finally:
        if fd >= 0:
            os.close(fd)
    return out


class Staging(Protocol):
    """Aligned, resident chunk slots (the engine's ``HostCache``): reads land here, then go to tensors."""

    chunk_bytes: int

    def acquire(self, timeout: float) -> int: ...
    def release(self, slot: int) -> None: ...
    def view(self, slot: int) -> torch.Tensor: ...
    def memory(self, slot: int, nbytes: int) -> memoryview: ...


def read_into(path: str, entry: dict, targets: dict[str, torch.Tensor], staging: Staging, *, verify: bool = True,
              o_direct: bool | str = "auto", threads: int = 4, timeout_s: float = 1800.0) -> None:
    """Fill existing tensors (e.g. a model's) with their saved bytes, through ``staging``'s slots.

    The memory of freshly allocated tensors must be faulted in page by page, which on some
    machines costs more than the disk read itself; resident staging slots plus one copy into
    tensors that already exist avoid it. Checksums are computed from the filled tensors.
    """
    metas = {}
    for name, target in targets.items():
        meta = entry["tensors"].get(name)
        if meta is None:
            raise CheckpointError(f"{entry['tensor_file']} lacks tensor {name!r}")
        if torch_dtype(meta["dtype"]) != target.dtype or list(meta["shape"]) != list(target.shape):
            raise CheckpointError(f"{path}: tensor {name!r} is {meta['dtype']}{meta['shape']} in the checkpoint, "
                                  f"the target is {target.dtype}{list(target.shape)}")
        metas[name] = meta
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in targets.values()):
        # Devices and strided targets: one pinned host buffer, then async copies (CUDA path, thin).
        fresh = read_tensors(path, entry, list(targets), verify=verify, o_direct=o_direct, threads=threads,
                             pin=torch.cuda.is_available(), timeout_s=timeout_s)
        for name, target in targets.items():
            target.copy_(fresh[name], non_blocking=fresh[name].is_pinned())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return
    order = sorted((n for n in metas if metas[n]["offsets"][1] > metas[n]["offsets"][0]),
                   key=lambda n: metas[n]["offsets"][0])
    flat = {n: targets[n].reshape(-1).view(torch.uint8) for n in order}
    spans = _spans([tuple(metas[n]["offsets"]) for n in order], entry["size"])
    if not spans:
        return
    deadline = time.monotonic() + timeout_s
    size = entry["size"]
    fd = open_for_read(path, o_direct)[0]

    def piece(off: int, length: int, segments: list[tuple[str, int, int]]) -> None:
        slot = staging.acquire(max(0.0, deadline - time.monotonic()))
        try:
            want = min(length, size - off)
            memory = staging.memory(slot, length)
            got = 0
            while got < want:
                n = os.preadv(fd, [memory[got:]], off + got)
                if n == 0:
                    raise CheckpointError(f"{path} is truncated (ends before byte {off + want})")
                got += n
            chunk = staging.view(slot)
            for name, lo, hi in segments:
                begin = metas[name]["offsets"][0]
                flat[name][lo - begin: hi - begin].copy_(chunk[lo - off: hi - off])
        finally:
            staging.release(slot)

    step = min(READ_PIECE, staging.chunk_bytes)
    futures: list[tuple[int, cf.Future]] = []  # (file offset of the piece, its future)
    hashes: list[tuple[str, str, cf.Future]] = []
    try:
        reads, hasher = _pool("read", threads), _pool("hash", max(1, os.cpu_count() or 1))
        i = 0
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
                futures.append((off, reads.submit(piece, off, end - off, segments)))
        done = 0
        for name in order:
            tensor_end = metas[name]["offsets"][1]
            while done < len(futures) and futures[done][0] < tensor_end:
                futures[done][1].result(timeout=max(0.0, deadline - time.monotonic()))
                done += 1
            expected = metas[name].get("xxh3_64")
            if verify and expected is not None:
                hashes.append((name, expected, hasher.submit(_digest, flat[name])))
        for _, future in futures[done:]:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        for name, expected, future in hashes:
            if future.result(timeout=max(0.0, deadline - time.monotonic())) != expected:
                raise CheckpointError(f"{path}: tensor {name!r} fails its checksum")
    except cf.TimeoutError:
        _cancel([f for _, f in futures], timeout_s)
        raise CheckpointError(f"reading {path} did not finish within {timeout_s:.0f}s (timeout)") from None
    except CheckpointError:
        _cancel([f for _, f in futures], timeout_s)
        raise
    except (OSError, CacheError) as exc:
        _cancel([f for _, f in futures], timeout_s)
        raise CheckpointError(f"reading {path} failed: {exc}") from exc
    finally:
        os.close(fd)


_default_staging: dict[int, HostCache] = {}


def default_staging(threads: int) -> HostCache:
    """Staging slots for readers without an engine's host cache: two per thread, kept for reuse."""
    with _pools_lock:
        if threads not in _default_staging:
            _default_staging[threads] = HostCache(2 * threads * READ_PIECE, READ_PIECE, pin=torch.cuda.is_available())
        return _default_staging[threads]


def _cancel(futures: list[cf.Future], timeout: float) -> None:
    """After a failure: cancel what has not started, wait for what has (it uses the file and buffers)."""
    for future in futures:
        future.cancel()
    cf.wait(futures, timeout=timeout)


def _digest(view: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(view.numpy()))


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
