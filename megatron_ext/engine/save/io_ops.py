"""The flush's file operations on the host cache's memory: checksum and write a run of slots, make
a file durable, write a small file atomically, copy a file to the next level.

They run in the I/O worker process (io_worker.py), so that none of their system calls and
checksum updates takes the training process's GIL, or, with ``flush_process: false``, on the
calling thread. Either way through ``FileIo``; this module imports neither torch nor the save
pipeline, so the worker process starts in a few tens of milliseconds.

Checksums are xxh3-64 (docs/FORMAT.md): one over the whole tensor file, one per tensor, one over
the sidecar. A run's checksums are computed on a second thread while the calling thread writes the
same bytes whenever the write is O_DIRECT (the device moves the bytes: the writing thread waits
and takes no core), and for page-cache writes only where the node has cores to spare
(``overlap``): there the write is a memory copy that needs a core of its own.
"""

from __future__ import annotations

import errno
import mmap
import os

import xxhash

from ..files import ChunkFile, atomic_write, fsync_dir, round_up, write_durable
from ..priority import lowest_cpu_priority


class IoError(Exception):
    """An operation failed for a reason other than the operating system's (a checksum mismatch)."""


_EMPTY_DIGEST = xxhash.xxh3_64().hexdigest()


class _OpenFile:
    """A tensor file being written: its descriptor and its running checksums."""

    __slots__ = ("out", "spans", "whole", "tensors", "next_span")

    def __init__(self, out: ChunkFile, spans: list[int]):
        self.out = out
        self.spans = spans  # [start0, end0, start1, end1, ...]: each tensor's bytes in the file, in file order
        self.whole = xxhash.xxh3_64()
        self.tensors: dict[int, "xxhash.xxh3_64"] = {}
        self.next_span = 0  # first tensor not yet checksummed to its end


class FileIo:
    """The operations, on ``buffer``: the whole host cache (a writable memoryview).

    An O_DIRECT run is checksummed on a second thread while it is written: the write waits for the
    device, so hashing meanwhile costs no core and the run takes max(checksum, write) instead of
    their sum (the flush kept up with the O_DIRECT write only this way, docs/BENCHMARKS.md); without
    ``overlap`` that thread runs at the lowest priority, so it only takes a core nobody else wants. A
    page-cache write is a copy on the writing thread's core: with ``overlap`` it is checksummed
    alongside too; without, one after the other, which keeps one core busy instead of two (on a
    node with few cores per rank the training thread would wait for the other).
    """

    def __init__(self, buffer: memoryview, overlap: bool = True):
        self.buffer = buffer
        self.overlap_buffered = overlap
        self._files: dict[int, _OpenFile] = {}
        self._checksums = None  # the second thread, started at the first run that overlaps
        self._bounce: mmap.mmap | None = None  # ``stage``'s page-aligned buffer, made at its first use

    def run(self, file: int, offset: int, cache: int, nbytes: int, *, path: str | None = None,
            direct: bool = False, spans: list[int] | None = None) -> None:
        """File bytes [offset, offset + nbytes) from cache bytes [cache, cache + nbytes): checksummed
        (on the second thread) while written. The file's first run gives its ``path`` (created, with
        O_DIRECT if ``direct``) and its tensors' ``spans``."""
        if path is not None:
            self.abort(file)  # a first run again (retried without O_DIRECT): start over
            self._files[file] = _OpenFile(ChunkFile(path, direct), list(spans or ()))
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
            # the lowest priority it never takes the core of the training thread (docs/BENCHMARKS.md).
            self._checksums = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="datastates-io-checksum",
                initializer=None if self.overlap_buffered else lowest_cpu_priority)
        summed = self._checksums.submit(_checksum, f, data, offset)
        try:
            f.out.write_at(offset, written)
        finally:
            summed.result()

    def finish(self, file: int, size: int, sidecar_path: str, sidecar: bytes) -> dict:
        """The file's last run is written: cut the O_DIRECT padding, fsync it, write the sidecar
        durably, fsync their directory once. Returns the checksums (hex): ``file``, ``tensors``
        (in file order) and ``sidecar``."""
        f = self._files.pop(file)
        f.out.close(size, sync_dir=False)
        write_durable(sidecar_path, sidecar)
        fsync_dir(os.path.dirname(sidecar_path))
        count = len(f.spans) // 2
        return {"file": f.whole.hexdigest(),
                "tensors": [f.tensors[k].hexdigest() if k in f.tensors else _EMPTY_DIGEST for k in range(count)],
                "sidecar": xxhash.xxh3_64_hexdigest(sidecar)}

    def abort(self, file: int) -> None:
        """Give up a file being written (its descriptor closed; whatever was written stays)."""
        f = self._files.pop(file, None)
        if f is not None:
            f.out.abort()

    def atomic_write(self, path: str, data: bytes) -> None:
        atomic_write(path, data)

    def stage(self, src: str, dst: str, direct: bool, expected: str | None, chunk_bytes: int) -> None:
        """Copy ``src`` to ``dst`` durably through a bounce buffer, checksumming on the way: a
        corrupt copy (``expected`` differs) never passes unnoticed."""
        if self._bounce is None or len(self._bounce) != chunk_bytes:
            self._bounce = mmap.mmap(-1, chunk_bytes)
        view = memoryview(self._bounce)
        size = os.path.getsize(src)
        out = ChunkFile(dst, direct)
        digest = xxhash.xxh3_64()
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
        except BaseException:
            out.abort()
            raise
        out.close(size)
        if expected is not None and digest.hexdigest() != expected:
            raise IoError(f"checksum mismatch while staging {src} to the shared level")

    def close(self) -> None:
        for file in list(self._files):
            self.abort(file)
        if self._checksums is not None:
            self._checksums.shutdown(wait=True)


def _checksum(f: _OpenFile, data: memoryview, offset: int) -> None:
    """Fold file bytes [offset, offset + len(data)) into the file's checksum and its tensors'."""
    f.whole.update(data)
    end = offset + len(data)
    spans = f.spans
    k = f.next_span
    while 2 * k < len(spans) and spans[2 * k] < end:  # tensors are in file order
        start, stop = spans[2 * k], spans[2 * k + 1]
        lo, hi = max(start, offset), min(stop, end)
        if hi > lo:
            h = f.tensors.get(k)
            if h is None:
                h = f.tensors[k] = xxhash.xxh3_64()
            h.update(data[lo - offset:hi - offset])
        if stop > end:
            break
        k += 1
    f.next_span = k


def os_error_fields(exc: OSError) -> dict:
    """What the parent needs to raise the same ``OSError``."""
    return {"errno": exc.errno, "strerror": exc.strerror or str(exc), "filename": exc.filename}


def raise_os_error(fields: dict) -> None:
    raise OSError(fields.get("errno") or errno.EIO, fields.get("strerror") or "I/O error", fields.get("filename"))


__all__ = ["FileIo", "IoError", "os_error_fields", "raise_os_error"]
