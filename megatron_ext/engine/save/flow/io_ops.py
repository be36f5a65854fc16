"""The flush's file operations on the host cache's memory: checksum and write a run of slots, make
a file durable, write a small file atomically, copy a file to the next level.

They run in the I/O worker process (io_worker.py), so that none of their system calls and
checksum updates takes the training process's GIL, or, with ``flush_process: false``, on the
calling thread. Either way through ``FileIo`` and one table, ``OPERATIONS``: a request (a frozen
dataclass naming its operation) goes to its handler there, and the reply is a frozen dataclass
too (``FileChecksums``) or ``None``; a failure in the worker comes back as a ``Failure``. Adding an
operation is a request class and a row in the table. This module imports neither torch nor the
save pipeline, so the worker process starts in a few tens of milliseconds.

Checksums are xxh3-64 (docs/FORMAT.md): one per tensor, the tensor file's made of its pieces' (its
header's and its tensors', ``format/digest.py``: each byte is hashed once), one over the sidecar. A
run's checksums are computed on a second thread while the calling thread writes the
same bytes whenever the write is O_DIRECT (the device moves the bytes: the writing thread waits
and takes no core), and for page-cache writes only where the node has cores to spare
(``overlap``): there the write is a memory copy that needs a core of its own.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import mmap
import os
from typing import Any, Callable, ClassVar

import xxhash

from ... import object_store
from ...files import ChunkFile, atomic_write, fsync_dir, round_up, write_durable
from ...object_store import is_object_url
from ...format.digest import FileChecksums, FileDigest, cuts_of
from ...priority import lowest_cpu_priority
from ...threads import name_os_thread


class IoError(Exception):
    """An operation failed for a reason other than the operating system's (a checksum mismatch)."""


_EMPTY_DIGEST = xxhash.xxh3_64().hexdigest()


# ------------------------------------------------------------------ what crosses the process boundary
# Pickled over the worker's connection: both ends are this package; no checkpoint file's bytes are
# ever unpickled (a sidecar or a report travels as ``bytes`` inside a request).

@dataclasses.dataclass(frozen=True)
class RunRequest:
    """Write file bytes [offset, offset + nbytes) from cache bytes [cache, cache + nbytes),
    checksummed; a file's first run names its ``path`` (``direct``: O_DIRECT) and tensor ``spans``."""

    op: ClassVar[str] = "run"
    file: int
    offset: int
    cache: int
    nbytes: int
    path: str | None = None
    direct: bool = False
    spans: tuple[int, ...] | None = None  # start0, end0, start1, end1, ...: in file order
    size: int | None = None  # the whole file's, on its first run (an upload's part size follows it)


@dataclasses.dataclass(frozen=True)
class FinishRequest:
    """The file's last run is written: make it (``size`` bytes) and its ``sidecar`` durable."""

    op: ClassVar[str] = "finish"
    file: int
    size: int
    sidecar_path: str
    sidecar: bytes


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    """Give up a file being written."""

    op: ClassVar[str] = "abort"
    file: int


@dataclasses.dataclass(frozen=True)
class AtomicWriteRequest:
    """Write a small file (a report, a manifest) atomically and durably."""

    op: ClassVar[str] = "atomic_write"
    path: str
    data: bytes


@dataclasses.dataclass(frozen=True)
class StageRequest:
    """Copy ``src`` to ``dst`` durably, checking its checksum against ``expected`` on the way."""

    op: ClassVar[str] = "stage"
    src: str
    dst: str
    direct: bool
    expected: str | None
    chunk_bytes: int
    cuts: tuple[int, ...] | None = None  # a tensor file's pieces (format/digest.py); None: a plain file


@dataclasses.dataclass(frozen=True)
class Failure:
    """The reply of a request that raised in the worker: an ``OSError``'s errno, text and file
    name (raised again as an ``OSError`` in the caller), or any other error's ``message``."""

    message: str
    os_error: bool = False
    errno: int | None = None
    filename: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        if isinstance(exc, OSError):
            return cls(exc.strerror or str(exc), True, exc.errno, exc.filename)
        return cls(str(exc) if isinstance(exc, IoError) else f"{type(exc).__name__}: {exc}")

    def raise_again(self) -> None:
        """In the caller: the same ``OSError``, else an ``IoError`` with the message."""
        if self.os_error:
            raise OSError(self.errno or errno.EIO, self.message or "I/O error", self.filename)
        raise IoError(self.message)


class _OpenFile:
    """A tensor file being written: its descriptor, its tensors' spans and its running checksum."""

    __slots__ = ("out", "spans", "digest")

    def __init__(self, out: "ChunkFile | object_store.Upload", spans: list[int]):
        self.out = out
        self.spans = spans  # [start0, end0, start1, end1, ...]: each tensor's bytes in the file, in file order
        cuts = cuts_of(spans[0], zip(spans[0::2], spans[1::2])) if spans else []
        self.digest = FileDigest(cuts)  # its pieces are the header and the tensors: their digests too


class FileIo:
    """The operations, on ``buffer``: the whole host cache (a writable memoryview).

    An O_DIRECT run is checksummed on a second thread while it is written: the write waits for the
    device, so hashing meanwhile costs no core and the run takes max(checksum, write) instead of
    their sum (the flush kept up with the O_DIRECT write only this way;
    docs/history/BENCHMARKS-to-2026-12.md, "bench engine"); without ``overlap`` that thread runs at
    the lowest priority, so it only takes a core nobody else wants. A page-cache write is a copy on
    the writing thread's core: with ``overlap`` it is checksummed alongside too; without, one after
    the other, which keeps one core busy instead of two (on a node with few cores per rank the
    training thread would wait for the other).
    """

    def __init__(self, buffer: memoryview, overlap: bool = True):
        self.buffer = buffer
        self.overlap_buffered = overlap
        self._files: dict[int, _OpenFile] = {}
        self._checksums = None  # the second thread, started at the first run that overlaps
        self._bounce: mmap.mmap | None = None  # ``stage``'s page-aligned buffer, made at its first use

    def run(self, file: int, offset: int, cache: int, nbytes: int, *, path: str | None = None,
            direct: bool = False, spans: list[int] | None = None, size: int | None = None) -> None:
        """File bytes [offset, offset + nbytes) from cache bytes [cache, cache + nbytes): checksummed
        (on the second thread) while written. The file's first run gives its ``path`` (created, with
        O_DIRECT if ``direct``; on the object-store level a multipart upload, its parts straight
        from the cache), its tensors' ``spans`` and its ``size``."""
        if path is not None:
            self.abort(file)  # a first run again (retried without O_DIRECT): start over
            self._files[file] = _OpenFile(_writer(path, direct, size), list(spans or ()))
        f = self._files[file]
        data = self.buffer[cache:cache + nbytes]
        written = self.buffer[cache:cache + round_up(nbytes)] if f.out.direct else data
        if not (f.out.direct or self.overlap_buffered):
            _checksum(f, data, offset)
            f.out.write_at(offset, written)
            return
        if self._checksums is None:
            import concurrent.futures  # only here: the worker process starts faster without it

            # Without a core to spare (``overlap`` off) the checksum only fills the write's wait: at
            # the lowest priority it never takes the core of the training thread
            # (docs/history/BENCHMARKS-to-2026-12.md, "bench python-loop").
            self._checksums = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="datastates-io-checksum",
                initializer=_checksum_thread_start, initargs=(not self.overlap_buffered,))
        summed = self._checksums.submit(_checksum, f, data, offset)
        try:
            f.out.write_at(offset, written)
        finally:
            summed.result()

    def finish(self, file: int, size: int, sidecar_path: str, sidecar: bytes) -> FileChecksums:
        """The file's last run is written: cut the O_DIRECT padding, fsync it, write the sidecar
        durably, fsync their directory once. Returns its checksums."""
        f = self._files.pop(file)
        f.out.close(size, sync_dir=False)
        if is_object_url(sidecar_path):  # an object is durable once its write is answered
            object_store.put(sidecar_path, sidecar)
        else:
            write_durable(sidecar_path, sidecar)
            fsync_dir(os.path.dirname(sidecar_path))
        file_digest = f.digest.hexdigest()
        pieces = {(start, end): digest for start, end, digest in f.digest.pieces}
        tensors = []
        for start, end in zip(f.spans[0::2], f.spans[1::2]):
            if end == start:
                tensors.append(_EMPTY_DIGEST)
            elif (start, end) in pieces:
                tensors.append(f"{pieces[start, end]:016x}")
            else:
                raise IoError(f"{f.out.path}: finished with bytes [{start}, {end}) of a tensor not written")
        return FileChecksums(file=file_digest, tensors=tuple(tensors), sidecar=xxhash.xxh3_64_hexdigest(sidecar))

    def abort(self, file: int) -> None:
        """Give up a file being written (its descriptor closed; whatever was written stays)."""
        f = self._files.pop(file, None)
        if f is not None:
            f.out.abort()

    def atomic_write(self, path: str, data: bytes) -> None:
        write_whole(path, data)

    def stage(self, src: str, dst: str, direct: bool, expected: str | None, chunk_bytes: int,
              cuts: list[int] | None = None) -> None:
        """Copy ``src`` to ``dst`` durably through a bounce buffer, checksumming on the way (in
        pieces at ``cuts`` for a tensor file): a corrupt copy (``expected`` differs) never passes unnoticed."""
        if is_object_url(dst):  # parts of an upload go up in parallel: read enough for all of them
            chunk_bytes = max(chunk_bytes, object_store.CONCURRENCY * object_store.PART_BYTES)
        if self._bounce is None or len(self._bounce) != chunk_bytes:
            self._bounce = mmap.mmap(-1, chunk_bytes)
        view = memoryview(self._bounce)
        size = os.path.getsize(src)
        out = _writer(dst, direct, size)
        digest = FileDigest(cuts)
        try:
            with open(src, "rb", buffering=0) as source:
                done = 0
                while done < size:
                    n = source.readinto(view[:min(len(view), size - done)])
                    if not n:
                        raise IoError(f"{src} shrank while being staged")
                    digest.update(view[:n])
                    out.write_at(done, view[:round_up(n)] if out.direct else view[:n])
                    done += n
            if expected is not None and digest.hexdigest() != expected:  # before an upload completes
                raise IoError(f"checksum mismatch while staging {src} to the shared level")
        except BaseException:
            out.abort()
            raise
        out.close(size)

    def close(self) -> None:
        for file in list(self._files):
            self.abort(file)
        if self._checksums is not None:
            self._checksums.shutdown(wait=True)


def _writer(path: str, direct: bool, size: int | None) -> "ChunkFile | object_store.Upload":
    """What a file is written through: a ``ChunkFile``, or on the object-store level an upload."""
    return object_store.Upload(path, size) if is_object_url(path) else ChunkFile(path, direct)


def write_whole(path: str, data: bytes) -> None:
    """A small file (a report, a manifest) all or nothing: temp file, fsync, rename and directory
    fsync on a file system; one PUT on the object-store level (an object appears whole or not at all)."""
    if is_object_url(path):
        object_store.put(path, data)
    else:
        atomic_write(path, data)


def write_record(path: str, record: dict) -> None:
    """A small JSON record (a failure or skip report) written whole, its directory made if needed."""
    if not is_object_url(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    write_whole(path, json.dumps(record, indent=1, sort_keys=True).encode("utf-8"))


def _checksum_thread_start(lowest_priority: bool) -> None:
    name_os_thread("datastates-io-checksum")
    if lowest_priority:
        lowest_cpu_priority()


def _checksum(f: _OpenFile, data: memoryview, offset: int) -> None:
    """Fold file bytes [offset, offset + len(data)) into the file's checksum (runs come in file order)."""
    if offset != f.digest.position:
        raise IoError(f"a run at offset {offset} of a file checksummed up to {f.digest.position}: runs out of order")
    f.digest.update(data)


#: Every operation, by request name: the one dispatch of ``io_worker.LocalIo`` (in this process)
#: and of the worker process. A handler takes the ``FileIo`` and the request; it returns the reply.
OPERATIONS: dict[str, Callable[[FileIo, Any], Any]] = {
    RunRequest.op: lambda io, r: io.run(r.file, r.offset, r.cache, r.nbytes, path=r.path, direct=r.direct,
                                        spans=None if r.spans is None else list(r.spans), size=r.size),
    FinishRequest.op: lambda io, r: io.finish(r.file, r.size, r.sidecar_path, r.sidecar),
    AbortRequest.op: lambda io, r: io.abort(r.file),
    AtomicWriteRequest.op: lambda io, r: io.atomic_write(r.path, r.data),
    StageRequest.op: lambda io, r: io.stage(r.src, r.dst, r.direct, r.expected, r.chunk_bytes,
                                            None if r.cuts is None else list(r.cuts)),
}


def perform(io: FileIo, request: Any) -> Any:
    """``request``'s operation on ``io``, through ``OPERATIONS``: its reply (raises what it raises)."""
    handler = OPERATIONS.get(request.op)
    if handler is None:
        raise IoError(f"unknown request {request.op!r}")
    return handler(io, request)


__all__ = ["FileIo", "IoError", "OPERATIONS", "perform", "write_whole", "write_record", "RunRequest", "FinishRequest", "AbortRequest",
           "AtomicWriteRequest", "StageRequest", "Failure"]
