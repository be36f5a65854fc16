"""Flushing: host cache to the first storage level, then (optionally) node-local to shared.

``RankWriter`` is this rank's writer thread. It takes filled runs of cache slots in file order and
hands each to the I/O worker (io_worker.py) as one request: the worker checksums the run (xxh3-64
of the file and of each tensor in it) while it writes it at its offset, with ``O_DIRECT`` where
the level allows it, and answers once both are done; the slots are then free again. A file's end
is one more request: cut the O_DIRECT padding, fsync, write the sidecar, fsync the directory,
answer the checksums. The first level is the node-local directory when one is configured, else
the shared one. The writer itself makes one request and waits for one reply per run, whatever
the number of tensors: that is all the GIL it takes (docs/ARCHITECTURE.md, "The GIL").

``LevelStager`` then has the worker copy each durable node-local file to the shared directory
through a bounce buffer, checking the checksum on the way, so a corrupt local copy never
reaches the shared level unnoticed.

Fault hooks (faults.py) run here, in the training process, right before each request that
writes: a hook that raises fails that file as a failed write would.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from typing import TYPE_CHECKING, Callable

from ... import faults
from ...device import bind_thread
from ...errors import CheckpointError
from ... import object_store
from ...files import supports_o_direct
from ...object_store import is_object_url
from ...format.names import LEVEL_LOCAL, LEVEL_SHARED
from ...host_cache import HostCache
from ..context import SaveContext
from ..job.jobs import CheckpointJob, FileJob
from ..job.messages import Chunk, Discard
from .io_ops import write_record
from .io_worker import IoChannel
from .worker import QueueWorker

if TYPE_CHECKING:
    from ..job.signal import CommitSignal

log = logging.getLogger("megatron_ext.engine")


def _use_direct(setting, directory: str) -> bool:
    if setting is False or is_object_url(directory):  # an object store has no O_DIRECT: its writes are requests
        return False
    ok = supports_o_direct(directory)
    if setting is True and not ok:
        raise CheckpointError(f"o_direct=true but {directory!r} does not support O_DIRECT")
    return ok


class DirectChoice:
    """Whether a level root takes O_DIRECT writes: probed once per root, not per checkpoint
    directory (a probe is six system calls on the writing thread)."""

    def __init__(self, setting):
        self.setting = setting
        self._by_root: dict[str, bool] = {}

    def __call__(self, root: str) -> bool:
        direct = self._by_root.get(root)
        if direct is None:
            direct = self._by_root[root] = _use_direct(self.setting, root)
        return direct

    def attempt(self, root: str, directory: str, write: Callable[[bool], None]) -> None:
        """``write(direct)`` with the root's choice; where O_DIRECT is refused with EINVAL anyway
        (another file system mounted under the root), once more with ``directory``'s own."""
        direct = self(root)
        try:
            write(direct)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            write(_use_direct(self.setting, directory))


class RankWriter(QueueWorker):
    """Writes runs of chunks in file order through the I/O worker, one request per run."""

    def __init__(self, ctx: SaveContext, cache: HostCache, next_stage: "LevelStager | CommitSignal", io: IoChannel):
        self.ctx = ctx
        self.cache = cache
        self.next = next_stage  # told of each durable file and each discard, in order
        self.io = io
        self.level = ctx.first_level
        self.fail = ctx.fail
        self._direct = DirectChoice(ctx.o_direct)
        self._numbers = itertools.count()  # the worker's name for each file being written
        self._open: dict[int, int] = {}  # id(FileJob) -> its number at the worker
        self._failed = False  # a fatal failure: nothing more is written
        self._failed_jobs: set[int] = set()  # files abandoned after a failure the engine survives
        # The writer waits on each chunk's CUDA event (``chunk.ready``): it binds to the rank's device.
        self.start(f"datastates-writer-{self.level}", lambda: bind_thread(ctx.device))

    def expect_writes(self) -> None:
        """A copy begins: have the I/O worker up by the time its first run is filled (once; cheap after)."""
        self.io.start_early()

    def take_back(self, job: CheckpointJob) -> None:
        """Pull a skipped checkpoint's queued chunks out of the pipeline and free their slots now."""
        for c in self.cancel(lambda item: isinstance(item, Chunk) and item.file.job is job):
            self.cache.release_run(c.slot, c.count)

    def handle(self, item: Chunk | Discard) -> None:
        if isinstance(item, Discard):
            self._discard(item)
            return
        chunk = item
        # The writer starts the flush (a flush starts, or its checkpoint is skipped, never both).
        dropped = not chunk.file.job.begin_flush()
        if self._failed or id(chunk.file) in self._failed_jobs or dropped:
            self.cache.release_run(chunk.slot, chunk.count)  # keep freeing slots: nobody waits on a dead file
            return
        stage = chunk.file.job.flush_stage
        held = stage.hold(self.ctx.timeout_s, lambda: f"the I/O worker to write {chunk.file.tensor_rel}")
        try:
            try:
                self._write(chunk)
            finally:
                self.cache.release_run(chunk.slot, chunk.count)
            if chunk.last:
                self._finish(chunk.file)
        except BaseException as exc:
            self._failed_jobs.add(id(chunk.file))
            self._abort(chunk.file)
            if self.fail(exc, chunk.file.job):
                self._failed = True
                for key in list(self._open):
                    self._abort_number(self._open.pop(key))
        finally:
            stage.release(held)

    def _write(self, chunk: Chunk) -> None:
        """One run to the worker: checksummed and written when this returns."""
        fjob = chunk.file
        root = self.ctx.directory(fjob, self.level)
        path = os.path.join(root, fjob.tensor_rel)
        chunk.ready()  # CUDA: the run's copies are complete
        faults.before_write(self.level, path, chunk.offset, chunk.nbytes)
        cache_offset = chunk.slot * self.cache.chunk_bytes
        if chunk.index > 0:
            self.io.run(self._open[id(fjob)], chunk.offset, cache_offset, chunk.nbytes)
            return
        directory = os.path.dirname(path)
        fjob.job.make_directory(directory)
        number = self._open[id(fjob)] = next(self._numbers)
        spans = [bound for s in fjob.layout.spans for bound in (s.start, s.end)]
        self._direct.attempt(root, directory, lambda direct: self.io.run(
            number, chunk.offset, cache_offset, chunk.nbytes, path=path, direct=direct, spans=spans,
            size=fjob.layout.size))
        faults.stop_point("mid_flush")

    def _finish(self, fjob: FileJob) -> None:
        """The file's last run is written: the worker makes it and its sidecar durable."""
        number = self._open.pop(id(fjob))
        sidecar_path = os.path.join(self.ctx.directory(fjob, self.level), fjob.sidecar_rel)
        faults.before_write(self.level, sidecar_path, 0, len(fjob.sidecar))
        sums = self.io.finish(number, fjob.layout.size, sidecar_path, fjob.sidecar)
        fjob.take_checksums(sums)
        fjob.job.mark_durable(fjob, self.level)
        self.next.durable(fjob)

    def _abort(self, fjob: FileJob) -> None:
        number = self._open.pop(id(fjob), None)
        if number is not None:
            self._abort_number(number)

    def _abort_number(self, number: int) -> None:
        try:
            self.io.abort(number)
        except Exception:  # the worker is gone or failing: the file is abandoned either way
            pass

    def _discard(self, item: Discard) -> None:
        """Every earlier chunk of the skipped checkpoint has passed: remove its files."""
        job = item.job
        try:
            if item.report is not None:
                try:
                    write_record(*item.report)
                except OSError as exc:  # the record is for inspect: its loss loses no checkpoint
                    log.warning("[datastates] rank %d: could not write the skip report %s: %s",
                                self.ctx.rank, item.report[0], exc)
            for f in job.files:
                self._abort(f)
                remove_files(self.ctx.directory(f, self.level), f)
            self.next.discard(item)  # the next level removes its copies after its own in-flight ones
        except BaseException as exc:
            if self.fail(exc, job):
                self._failed = True


class LevelStager(QueueWorker):
    """Copies files that are durable on the node-local level to the shared level (through the worker)."""

    def __init__(self, ctx: SaveContext, next_stage: "CommitSignal", io: IoChannel):
        self.ctx = ctx
        self.next = next_stage
        self.io = io
        self.fail = ctx.fail
        self._direct = DirectChoice(ctx.o_direct)
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
        stage = fjob.job.flush_stage
        held = stage.hold(2 * self.ctx.timeout_s, lambda: f"the I/O worker to copy {fjob.tensor_rel} to the shared level")
        try:
            self._copy(fjob.tensor_rel, fjob, fjob.file_xxh3, fjob.layout.size, fjob.layout.cuts())
            faults.stop_point("mid_stage")
            self._copy(fjob.sidecar_rel, fjob, fjob.sidecar_xxh3, len(fjob.sidecar), None)
            fjob.job.mark_durable(fjob, LEVEL_SHARED)
            self.next.durable(fjob)
        except BaseException as exc:
            self._failed = self.fail(exc, fjob.job)
        finally:
            stage.release(held)

    def _copy(self, rel: str, fjob: FileJob, expected: str | None, size: int, cuts: list[int] | None) -> None:
        """One file from the node-local level to shared, checked against ``expected`` (in pieces at ``cuts``)."""
        src_path = os.path.join(self.ctx.directory(fjob, LEVEL_LOCAL), rel)
        root = self.ctx.directory(fjob, LEVEL_SHARED)
        dst_path = os.path.join(root, rel)
        directory = os.path.dirname(dst_path)
        fjob.job.make_directory(directory)
        faults.before_write(LEVEL_SHARED, dst_path, 0, size)
        self._direct.attempt(root, directory, lambda direct: self.io.stage(
            src_path, dst_path, direct, expected, self.ctx.chunk_bytes, cuts))


def remove_files(root: str, job: FileJob) -> None:
    """Delete one saved file's tensor file and sidecar under a level's root, if present."""
    if is_object_url(root):
        object_store.delete([os.path.join(root, rel) for rel in (job.tensor_rel, job.sidecar_rel)])
        return
    for rel in (job.tensor_rel, job.sidecar_rel):
        try:
            os.unlink(os.path.join(root, rel))
        except FileNotFoundError:
            pass


__all__ = ["DirectChoice", "RankWriter", "LevelStager", "LEVEL_LOCAL", "LEVEL_SHARED"]
