"""Flushing: host cache to the first storage level, then (optionally) node-local to shared.

``RankWriter`` is this rank's writer thread. It takes filled runs of chunks in file order, checksums
them (xxh3-64 per tensor and per file: one ``update`` call per run and per tensor in it, which
releases the GIL above 64 KiB), writes each run at its offset in one call with ``O_DIRECT`` where the
directory allows it, frees the cache slot, and on a file's last chunk truncates the padding,
fsyncs the file and its directory and writes the sidecar. The first level is the node-local
directory when one is configured, else the shared one.

``LevelStager`` then copies each durable node-local file to the shared directory through a small
bounce buffer, checking the checksum on the way, so a corrupt local copy never reaches the
shared level unnoticed.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

import xxhash

from .. import faults
from ..device import bind_thread
from ..errors import CheckpointError
from ..files import ChunkFile, fsync_dir, supports_o_direct, write_durable
from ..format.names import LEVEL_LOCAL, LEVEL_SHARED
from ..format.safetensors import round_up
from ..host_cache import HostCache
from .context import SaveContext
from .jobs import CheckpointJob, FileJob
from .messages import Chunk, Discard
from .worker import QueueWorker

if TYPE_CHECKING:
    from .signal import CommitSignal


def _use_direct(setting, directory: str) -> bool:
    if setting is False:
        return False
    ok = supports_o_direct(directory)
    if setting is True and not ok:
        raise CheckpointError(f"o_direct=true but {directory!r} does not support O_DIRECT")
    return ok


class RankWriter:
    """Checksums and writes runs of chunks, in file order, on one thread or two.

    Two threads (``pipelined``) checksum run k+1 while run k is written: the flush's bandwidth where
    cores are to spare. One thread does both in turn where they are not (``flush_threads``,
    config.py): a checksum running beside the writer then keeps a core the writer's system calls
    wait for, and each such wait delays the thread that holds the GIL, so the training thread's
    with it (docs/ARCHITECTURE.md, "The GIL").
    """

    def __init__(self, ctx: SaveContext, cache: HostCache, next_stage: "LevelStager | CommitSignal",
                 pipelined: bool = True):
        self.ctx = ctx
        self.cache = cache
        self.next = next_stage  # told of each durable file and each discard, in order
        self.level = ctx.first_level
        self.fail = ctx.fail
        # Per file being checksummed: whole-file hash, per-tensor hashes, first unfinished tensor.
        self._hashing: dict[int, list] = {}
        self._files: dict[int, ChunkFile] = {}
        self._direct: dict[str, bool] = {}  # whether O_DIRECT works, by level root (probed once each)
        self._failed = threading.Event()  # a fatal failure: stop writing anything
        self._failed_jobs: set[int] = set()  # files abandoned after a failure the engine survives
        # The checksum stage waits on each chunk's CUDA event (``chunk.ready``): every thread binds
        # to the rank's device first (device.py).
        if pipelined:
            hashes: "queue.Queue[Chunk | Discard | None]" = queue.Queue()
            writes: "queue.Queue[Chunk | Discard | None]" = queue.Queue()
            self._queues = [hashes, writes]
            stages = [(hashes, True, False, writes, f"datastates-checksum-{self.level}"),
                      (writes, False, True, None, f"datastates-writer-{self.level}")]
        else:
            both: "queue.Queue[Chunk | Discard | None]" = queue.Queue()
            self._queues = [both]
            stages = [(both, True, True, None, f"datastates-writer-{self.level}")]
        self._threads = [threading.Thread(target=self._loop, args=(source, hashes_, writes_, forward),
                                          name=name, daemon=True)
                         for source, hashes_, writes_, forward, name in stages]
        for thread in self._threads:
            thread.start()

    def submit(self, item: Chunk | Discard) -> None:
        self._queues[0].put(item)

    def take_back(self, job: CheckpointJob) -> None:
        """Pull a skipped checkpoint's queued chunks out of the pipeline and free their slots now."""
        runs = []
        for q in self._queues:
            with q.mutex:
                mine = [c for c in q.queue if isinstance(c, Chunk) and c.file.job is job]
                if mine:
                    keep = [c for c in q.queue if not (isinstance(c, Chunk) and c.file.job is job)]
                    q.queue.clear()
                    q.queue.extend(keep)
            runs += [(c.slot, c.count) for c in mine]
        for slot, count in runs:
            self.cache.release_run(slot, count)

    def stop(self, timeout: float) -> None:
        self._queues[0].put(None)
        for thread in self._threads:
            thread.join(timeout)

    def _loop(self, source: "queue.Queue", hashes: bool, writes: bool, forward: "queue.Queue | None") -> None:
        """One thread's stage: checksums (``hashes``), writes (``writes``) or both; passes each item on."""
        bind_thread(self.ctx.device)
        while True:
            chunk = source.get()
            if chunk is None:
                if forward is not None:
                    forward.put(None)
                return
            if isinstance(chunk, Discard):
                self._discard(chunk, hashes, writes, forward)
                continue
            # The write stage starts the flush (a flush starts, or its checkpoint is skipped, never both).
            dropped = not chunk.file.job.begin_flush() if writes else chunk.file.job.abandoned
            if self._failed.is_set() or id(chunk.file) in self._failed_jobs or dropped:
                self.cache.release_run(chunk.slot, chunk.count)  # keep freeing slots: nobody waits on a dead file
                continue
            try:
                if hashes:
                    self._checksum(chunk)
                if writes:
                    self._write(chunk)
            except BaseException as exc:
                self.cache.release_run(chunk.slot, chunk.count)
                self._failed_jobs.add(id(chunk.file))
                broken = self._files.pop(id(chunk.file), None)
                if broken is not None:
                    broken.abort()
                if self.fail(exc, chunk.file.job):
                    self._failed.set()
                    for f in list(self._files.values()):
                        f.abort()
                continue
            if forward is not None:
                forward.put(chunk)

    def _discard(self, item: Discard, hashes: bool, writes: bool, forward: "queue.Queue | None") -> None:
        """Every earlier chunk of the skipped checkpoint has passed: drop its state, remove its files."""
        job = item.job
        if hashes:
            for f in job.files:
                self._hashing.pop(id(f), None)
        if not writes:
            forward.put(item)
            return
        try:
            for f in job.files:
                partial = self._files.pop(id(f), None)
                if partial is not None:
                    partial.abort()
                remove_files(self.ctx.directory(f, self.level), f)
            self.next.discard(item)  # the next level removes its copies after its own in-flight ones
        except BaseException as exc:
            if self.fail(exc, job):
                self._failed.set()

    def _checksum(self, chunk: Chunk) -> None:
        fjob = chunk.file
        key = id(fjob)
        if chunk.index == 0:
            self._hashing[key] = [xxhash.xxh3_64(), {}, 0]
        state = self._hashing[key]
        file_hash, tensor_hash = state[0], state[1]
        chunk.ready()
        payload = self.cache.memory(chunk.slot, chunk.nbytes)
        file_hash.update(payload)
        end = chunk.offset + chunk.nbytes
        spans = fjob.layout.spans
        k = state[2]
        while k < len(spans) and spans[k].start < end:  # tensors are in file order
            s = spans[k]
            lo, hi = max(s.start, chunk.offset), min(s.end, end)
            if hi > lo:
                tensor_hash.setdefault(s.name, xxhash.xxh3_64()).update(payload[lo - chunk.offset:hi - chunk.offset])
            if s.end > end:
                break
            k += 1
        state[2] = k
        if chunk.last:
            del self._hashing[key]
            empty = xxhash.xxh3_64().hexdigest()
            fjob.file_xxh3 = file_hash.hexdigest()
            fjob.tensor_xxh3 = {s.name: (tensor_hash[s.name].hexdigest() if s.name in tensor_hash else empty)
                               for s in spans}
            fjob.sidecar_xxh3 = xxhash.xxh3_64_hexdigest(fjob.sidecar)

    def _write(self, chunk: Chunk) -> None:
        fjob = chunk.file
        key = id(fjob)
        if chunk.index == 0:
            self._files[key] = self._open(fjob)
        f = self._files[key]
        data = self.cache.memory(chunk.slot, round_up(chunk.nbytes) if f.direct else chunk.nbytes)
        faults.before_write(self.level, f.path, chunk.offset, chunk.nbytes)
        f.write_at(chunk.offset, data)
        self.cache.release_run(chunk.slot, chunk.count)
        if chunk.last:
            del self._files[key]
            f.close(fjob.layout.size, sync_dir=False)  # one fsync of the directory below covers both files
            sidecar_path = os.path.join(self.ctx.directory(fjob, self.level), fjob.sidecar_rel)
            faults.before_write(self.level, sidecar_path, 0, len(fjob.sidecar))
            write_durable(sidecar_path, fjob.sidecar)
            fsync_dir(os.path.dirname(sidecar_path))
            fjob.durable_at[self.level] = time.monotonic()
            self.next.durable(fjob)

    def _open(self, fjob: FileJob) -> ChunkFile:
        """The file's first chunk: its directory made (once per checkpoint), the file created.

        Whether O_DIRECT works is probed once per level root, not per checkpoint directory (each
        probe is six system calls, each a GIL switch for the training thread); a directory under the
        root that refuses it anyway (another file system mounted there) is probed on its own.
        """
        root = self.ctx.directory(fjob, self.level)
        path = os.path.join(root, fjob.tensor_rel)
        directory = os.path.dirname(path)
        fjob.job.make_directory(directory)
        direct = self._direct.get(root)
        if direct is None:
            direct = self._direct[root] = _use_direct(self.ctx.o_direct, root)
        try:
            return ChunkFile(path, direct)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
        return ChunkFile(path, _use_direct(self.ctx.o_direct, directory))


class LevelStager(QueueWorker):
    """Copies files that are durable on the node-local level to the shared level."""

    def __init__(self, ctx: SaveContext, next_stage: "CommitSignal"):
        self.ctx = ctx
        self.next = next_stage
        self.fail = ctx.fail
        self._buffer = mmap.mmap(-1, ctx.chunk_bytes)  # page-aligned bounce buffer, allocated once
        self._failed = False
        self.start("datastates-stager")

    def durable(self, fjob: FileJob) -> None:
        """The writer made ``fjob`` durable on the node-local level: copy it to shared."""
        self.submit(fjob)

    def discard(self, item: Discard) -> None:
        """Behind the writer's removal of a skipped checkpoint's local files: remove both levels' copies."""
        self.submit(item)

    def handle(self, item: FileJob | Discard) -> None:
        if isinstance(item, Discard):
            try:
                for f in item.job.files:
                    remove_files(self.ctx.directory(f, LEVEL_LOCAL), f)
                    remove_files(self.ctx.directory(f, LEVEL_SHARED), f)
            except BaseException as exc:
                self._failed = self.fail(exc, item.job)
            return
        fjob = item
        if self._failed or fjob.job.abandoned:
            return
        try:
            self._copy(fjob.tensor_rel, fjob, fjob.file_xxh3)
            self._copy(fjob.sidecar_rel, fjob, fjob.sidecar_xxh3)
            fjob.durable_at[LEVEL_SHARED] = time.monotonic()
            self.next.durable(fjob)
        except BaseException as exc:
            self._failed = self.fail(exc, fjob.job)

    def _copy(self, rel: str, fjob: FileJob, expected: str | None) -> None:
        src_path = os.path.join(self.ctx.directory(fjob, LEVEL_LOCAL), rel)
        dst_path = os.path.join(self.ctx.directory(fjob, LEVEL_SHARED), rel)
        directory = os.path.dirname(dst_path)
        fjob.job.make_directory(directory)
        size = os.path.getsize(src_path)
        out = ChunkFile(dst_path, _use_direct(self.ctx.o_direct, directory))
        digest = xxhash.xxh3_64()
        view = memoryview(self._buffer)
        try:
            with open(src_path, "rb", buffering=0) as src:
                offset = 0
                while offset < size:
                    n = src.readinto(view[:min(len(view), size - offset)])
                    if not n:
                        raise CheckpointError(f"{src_path} shrank while being staged")
                    digest.update(view[:n])
                    faults.before_write(LEVEL_SHARED, dst_path, offset, n)
                    out.write_at(offset, view[:round_up(n)] if out.direct else view[:n])
                    offset += n
        except BaseException:
            out.abort()
            raise
        out.close(size)
        if expected is not None and digest.hexdigest() != expected:
            raise CheckpointError(f"checksum mismatch while staging {src_path} to the shared level")


def remove_files(root: str, job: FileJob) -> None:
    """Delete one saved file's tensor file and sidecar under a level's root, if present."""
    for rel in (job.tensor_rel, job.sidecar_rel):
        try:
            os.unlink(os.path.join(root, rel))
        except FileNotFoundError:
            pass


__all__ = ["RankWriter", "LevelStager", "LEVEL_LOCAL", "LEVEL_SHARED"]
