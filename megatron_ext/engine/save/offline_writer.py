"""``OfflineWriter``: one committed checkpoint of a whole world of ranks, written from one process.

Why: a tool that produces a checkpoint for N ranks (``megatron-ext convert``) has every rank's
state in one process. N ``CheckpointEngine``s there cost N host caches and N I/O worker
processes, all alive at once because rank 0's commit waits for every rank's report. This writer
has none of that: each file is written when it is saved, on the calling thread, through one
buffer of ``chunk_bytes``, so its memory does not grow with N or with the checkpoint.

What it writes is what the engine writes for the same states, byte for byte: the same planned
files (``file_plan.PlannedFile``: sidecar, safetensors layout), the same checksums
(``io_ops.FileIo``, also the I/O worker's), the same rank reports (``format.report``) and the
manifest assembled and checked by the same functions as rank 0's; the save directory's lock is
taken for the run as the engine's rank 0 takes it. Not written: telemetry (nothing trains here),
a node-local level, peer replicas. The checkpoint directory must be new (no earlier attempt's
files to keep apart from this one's). ``root`` may be an ``s3://`` URL (the object-store level):
each file is then a multipart upload of the buffer's runs, the buffer large enough for every part
of a run to go up at once, and the reports and the manifest one PUT each, the manifest last.
"""

from __future__ import annotations

import itertools
import mmap
import os
import uuid
from typing import Any, Callable, Mapping

import torch

from .. import object_store
from ..config import EngineConfig, check_object_root, check_writable_dir
from ..errors import CheckpointError, ConfigError
from ..format.catalog import entry_exists
from ..format.manifest import MANIFEST_SHARES, assemble_manifest, summarize_heads
from ..format.names import MANIFEST, REPORTS, RUN_ID, report_name, valid_name
from ..read.entries import CommittedManifest
from .commit.committer import checked_report
from .flow.copier import CpuCopier
from .flow.file_plan import PlannedFile, check_names
from .flow.flush import DirectChoice
from .flow.io_ops import FileIo, write_whole
from .job.jobs import CheckpointJob, FileJob
from .lifecycle.ownership import hold_root


class OfflineWriter:
    """``save`` writes one rank's file durably before it returns; ``commit`` writes every rank's
    report and the manifest. Host tensors only (no copy stream); use as a context manager, or
    call ``close`` (the lock on ``root``)."""

    def __init__(self, config: EngineConfig | Mapping[str, Any] | None, root: str, checkpoint: str, *,
                 world_size: int, version: int | None = None, run_id: str | None = None):
        self.config = (config.check_node() if isinstance(config, EngineConfig)
                       else EngineConfig.from_dict(config, probe=False))
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be a whole number >= 1, got {world_size!r}")
        if run_id is not None and (type(run_id) is not str or not RUN_ID.fullmatch(run_id)):
            raise ConfigError(f"run_id {run_id!r} must be 12 lowercase hex digits")
        if not valid_name(checkpoint):
            raise ValueError(f"checkpoint id {checkpoint!r} must be one non-hidden directory name")
        self.root, self.checkpoint = object_store.resolve_root(root), checkpoint
        self.world_size, self.version = world_size, version
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.classes = self.config.allowed_classes()
        self.checkpoint_dir = object_store.under(self.root, checkpoint)
        on_objects = object_store.is_object_url(self.root)
        if on_objects:
            check_object_root(self.root, "checkpoint directory")
        else:
            check_writable_dir(self.root, "checkpoint directory")
        if entry_exists(self.checkpoint_dir):
            raise CheckpointError(f"{self.checkpoint_dir} exists; an offline writer writes a new checkpoint only")
        self._jobs: dict[int, CheckpointJob] = {}
        self._names: dict[str, int] = {}  # file name -> the rank that saved it
        self._committed: dict | None = None
        self._lock = hold_root(self.root, self.run_id, "save_dir")
        chunk = self.config.chunk_bytes
        if on_objects:  # a run's parts go up in parallel (object_store.Upload): a run for all of them
            chunk = max(chunk, object_store.CONCURRENCY * object_store.PART_BYTES)
        try:
            self._buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants it
        except BaseException:
            self._lock.release()
            raise
        self._view = memoryview(self._buffer)
        self._io = FileIo(self._view, overlap=False)
        self._bytes = torch.frombuffer(self._buffer, dtype=torch.uint8)
        self._copier = CpuCopier()
        self._direct = DirectChoice(self.config.o_direct)
        self._numbers = itertools.count()

    # ------------------------------------------------------------------ saving
    def save(self, rank: int, state: Any, name: str | None = None, *, extra: dict | None = None) -> FileJob:
        """``state`` as rank ``rank``'s file ``name`` (default ``rankRRRRR``), durable when this returns."""
        if self._committed is not None or self._buffer.closed:
            raise CheckpointError(f"checkpoint {self.checkpoint}: save() after commit() or close()")
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise CheckpointError(f"rank {rank!r} outside world of size {self.world_size}")
        name = f"rank{rank:05d}" if name is None else name
        check_names(self.checkpoint, name)
        if name in self._names:
            raise CheckpointError(f"checkpoint {self.checkpoint} already has a file named {name!r} "
                                  f"(rank {self._names[name]}'s)")
        planned = PlannedFile.encode(state, self.checkpoint, name, rank, self.run_id,
                                     pickle_fallback=self.config.pickle_fallback, classes=self.classes)
        job = self._job(rank)
        fjob = planned.file_job(job, self._copier, None, extra)
        try:
            self._write(fjob)
        finally:
            for span in fjob.layout.spans:  # the caller's tensors are not held beyond this call
                span.tensor = None
        job.add_file(fjob)
        self._names[name] = rank
        return fjob

    def _job(self, rank: int) -> CheckpointJob:
        job = self._jobs.get(rank)
        if job is None:
            job = self._jobs[rank] = CheckpointJob(checkpoint=self.checkpoint, root=self.root, version=self.version,
                                                   tag=self.run_id)
        return job

    def _write(self, fjob: FileJob) -> None:
        """The file in buffer-sized runs (header, then tensor bytes), checksummed and written; then
        it and its sidecar made durable: what the snapshot scheduler and ``RankWriter`` do, in line."""
        layout, chunk = fjob.layout, len(self._buffer)
        path = object_store.under(self.root, fjob.tensor_rel)
        directory = os.path.dirname(path)
        fjob.job.make_directory(directory)
        number = next(self._numbers)
        spans = [bound for s in layout.spans for bound in (s.start, s.end)]
        seg = 0
        try:
            for start in range(0, layout.size, chunk):
                end = min(start + chunk, layout.size)
                head = layout.header_in(start, end)
                self._buffer[:len(head)] = head
                seg = self._copier.copy_range(layout, start, end, self._bytes, seg, lambda k: layout.spans[k].tensor)
                self._run(number, start, end - start, path, directory, spans if start == 0 else None)
            sums = self._io.finish(number, layout.size, object_store.under(self.root, fjob.sidecar_rel), fjob.sidecar)
        except OSError as exc:
            self._io.abort(number)
            if exc.filename is None:  # pwrite, fsync: the file is named here
                raise OSError(exc.errno, exc.strerror or str(exc), path) from exc
            raise
        except BaseException:
            self._io.abort(number)
            raise
        fjob.take_checksums(sums)

    def _run(self, number: int, offset: int, nbytes: int, path: str, directory: str, spans: list[int] | None) -> None:
        if spans is None:
            self._io.run(number, offset, 0, nbytes)
            return
        self._direct.attempt(self.root, directory, lambda direct: self._io.run(
            number, offset, 0, nbytes, path=path, direct=direct, spans=spans))

    # ------------------------------------------------------------------ committing
    def commit(self, on_committed: Callable[[dict], None] | None = None) -> dict:
        """Every rank's report (a rank that saved nothing reports no files), then the manifest; returns
        the committed manifest (its header; ``files`` and ``reports`` are read from disk when asked)."""
        if self._committed is not None:
            return self._committed
        if self._buffer.closed:
            raise CheckpointError(f"checkpoint {self.checkpoint}: commit() after close()")
        reports_dir = object_store.under(self.checkpoint_dir, REPORTS)
        heads: list[list] = []
        shares: dict[str, list[bytes]] = {part: [] for part in MANIFEST_SHARES}
        for rank in range(self.world_size):
            job = self._job(rank)
            job.make_directory(reports_dir)
            data, (head, share) = checked_report(job, rank, self.world_size)
            write_whole(object_store.under(reports_dir, report_name(rank, self.run_id)), data)
            heads.append([rank, *head])
            for part in MANIFEST_SHARES:
                shares[part].append(share[part])
        summary = summarize_heads(self.checkpoint, heads, range(self.world_size))
        header, data = assemble_manifest(self.checkpoint, self.run_id, self.version, self.world_size, summary, shares)
        # Each share was held to the loader's rules as it was made (``durable_share``), the rules
        # that span ranks by ``assemble_manifest``: what the engine's ranks and rank 0 check.
        write_whole(object_store.under(self.checkpoint_dir, MANIFEST), data)
        self._committed = CommittedManifest(header, self.checkpoint_dir)
        if on_committed is not None:
            on_committed(self._committed)
        return self._committed

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Release the buffer and the lock (an uncommitted checkpoint stays uncommitted: no manifest)."""
        if self._buffer.closed:
            return
        self._io.close()
        del self._bytes  # the tensor and the memoryview export the mapping: they go before it closes
        self._view.release()
        try:
            self._buffer.close()
        finally:
            self._lock.release()

    def __enter__(self) -> "OfflineWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


__all__ = ["OfflineWriter"]
