"""The snapshot scheduler: copies each saved file's bytes into host-cache slots, in order.

One background thread takes ``FileJob``s first-in first-out, cuts each file's byte stream (header,
then tensors) into chunks of the cache's slot size, waits for free slots (backpressure), copies,
and hands the filled slots to the flusher at once, so writing starts with the first run rather
than after the whole snapshot. It takes neighbouring free slots in runs (``run_slots``: half
the cache, at most 128 MiB) and copies all of a run's tensor parts in one call, so the GIL is
taken back once per run rather than once per tensor and chunk. When a file's last chunk is
copied its tensors are released and ``snapshot_done`` is set, and the job's waiters are told
(``FileJob.snapshot_finished``); ``wait_snapshot`` waits on those.

Under ``overload_policy="supersede"`` a copy that finds the cache full first lets the settler
(``overload.SkipSettler``, seen here as ``SkipSettling``) drop older checkpoints whose flush has not
started, and a copy whose checkpoint was skipped meanwhile stops at its next slot, releases the
tensors, and the settler sends a ``Discard`` behind its chunks. Skips decided on other threads
reach this one as a ``SettleSkip`` (``settle_later``): this thread alone settles skips.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from ... import faults
from ...config import OverloadPolicy
from ...device import bind_thread
from ...host_cache import HostCache
from ..context import SaveContext
from ..job.deadlines import StageDeadline
from ..job.jobs import CheckpointJob, FileJob
from ..job.messages import Chunk, SettleSkip
from .copier import CpuCopier
from .worker import QueueWorker

if TYPE_CHECKING:
    from .flush import RankWriter


class SkipSettling(Protocol):
    """What the snapshot thread asks of overload handling (``overload.SkipSettler``), which sits above
    this stage: the flow knows only these two calls."""

    def settle(self, job: CheckpointJob) -> None:
        """``job`` was skipped: once none of its copies is left, tell the peers and drop its files."""

    def supersede_older(self, newer: CheckpointJob) -> None:
        """The cache is full under "supersede": drop older checkpoints whose flush has not started."""


class _Abandoned(Exception):
    """The checkpoint of the file being copied was skipped: stop copying it."""


class SnapshotScheduler(QueueWorker):
    """Copies files into the cache in order; under "supersede" it never waits for the flush unasked.

    It publishes which copy waits for a free slot (``starved``, backpressure) and when a snapshot
    finishes, for ``wait_snapshot``; both are written by this thread only.
    """

    def __init__(self, ctx: SaveContext, cache: HostCache, copier: CpuCopier, writer: "RankWriter",
                 settler: SkipSettling):
        self.ctx = ctx
        self.cache = cache
        self.copier = copier
        self.writer = writer  # the next stage: every filled slot goes there at once
        self.settler = settler  # makes room under "supersede"; discards a skipped checkpoint once its copies are done
        self._dead = False
        #: The file whose copy waits for a free cache slot right now (backpressure), or None.
        self.starved: FileJob | None = None
        #: The starved copy's own bounded wait for cache space: on a near tie with ``wait_snapshot``'s
        #: deadline, the copy's error ("the flush is stuck") is the one raised.
        self.slot_wait = StageDeadline()
        self.start("datastates-snapshot", lambda: bind_thread(ctx.device))  # device.py

    def settle_later(self, job: CheckpointJob) -> None:
        """``job`` was skipped on another thread: this one settles it, behind its queued copies."""
        self.submit(SettleSkip(job))

    def _starving(self, fjob: FileJob | None) -> None:
        """``fjob``'s copy starts waiting for cache space (None: it got its slots)."""
        self.starved = fjob
        if fjob is not None:
            fjob.job.wake()

    def handle(self, item: FileJob | SettleSkip) -> None:
        if isinstance(item, SettleSkip):
            try:
                self.settler.settle(item.job)
            except BaseException as exc:
                self.ctx.fail(exc, item.job)
            return
        fjob = item
        if self._dead:  # after a failure nothing more is copied; waiters wake up and see the error
            fjob.snapshot_finished()
            return
        try:
            if fjob.job.abandoned:
                raise _Abandoned()
            if fjob.gate is not None:  # values still being filled in by the caller (copy_gate.py)
                fjob.gate.wait(time.monotonic() + self.ctx.timeout_s, self.ctx.check)
            self.writer.expect_writes()
            self._copy_file(fjob)
        except _Abandoned:
            self.copier.finish()  # no copy may still read the caller's tensors after snapshot_done
            self._release(fjob)
            fjob.snapshot_finished()
        except BaseException as exc:
            self._dead = True
            self.ctx.fail(exc, None)  # the copy path is shared by all checkpoints: always fatal
            fjob.snapshot_finished()
        if fjob.job.abandoned:
            try:
                self.settler.settle(fjob.job)
            except BaseException as exc:
                self.ctx.fail(exc, fjob.job)

    def _slots(self, fjob: FileJob, most: int) -> tuple[int, int]:
        """Free neighbouring cache slots for ``fjob``'s next chunks, ``(first, count)`` with 1 <= count <= most;
        under "supersede", older pending checkpoints make room."""
        ckpt = fjob.job
        if ckpt.abandoned:
            raise _Abandoned()
        if ckpt.policy == OverloadPolicy.SUPERSEDE and self.cache.free_slots == 0:
            self.settler.supersede_older(ckpt)

        def check() -> None:
            self.ctx.check()
            if ckpt.abandoned:
                raise _Abandoned()

        self.slot_wait.hold(self.ctx.timeout_s, lambda: "a free host-cache slot")
        try:
            return self.cache.acquire_run(most, self.ctx.timeout_s, check, lambda: self._starving(fjob))
        finally:
            self.slot_wait.release()
            self._starving(None)

    @staticmethod
    def _release(fjob: FileJob) -> None:
        """The checkpoint holds the values now, or never will: let the caller's tensors go."""
        for s in fjob.layout.spans:
            s.tensor = None

    def _copy_file(self, fjob: FileJob) -> None:
        """The file's chunks in runs of neighbouring slots: one batched copy and one writer item per run."""
        layout = fjob.layout
        chunk = self.cache.chunk_bytes
        self.copier.begin(fjob.cuda_mark)  # a gated file's mark is taken when its gate opens
        # What each tensor is copied from (a CUDA temporary for a strided one), made when its first
        # bytes are copied and dropped once its last are queued: a file's temporaries never all at once.
        sources: dict[int, object] = {}

        def source(k: int):
            if k not in sources:
                sources[k] = self.copier.prepare(layout.spans[k].tensor)
            return sources[k]

        seg = 0  # first tensor that may overlap the current run (tensors are in file order)
        count = fjob.num_chunks(chunk)
        most = run_slots(self.cache)
        index = 0
        while index < count:
            slot, taken = self._slots(fjob, min(most, count - index))
            start = index * chunk
            end = min(start + taken * chunk, layout.size)
            head = layout.header_in(start, end)
            if head:
                self.cache.memory(slot, len(head))[:] = head
            seg = self.copier.copy_range(layout, start, end, self.cache.run_view(slot, taken), seg, source)
            for done in [k for k in sources if layout.spans[k].end <= end]:
                del sources[done]
            index += taken
            if index == taken:
                faults.stop_point("mid_copy")
            self.writer.submit(Chunk(fjob, index - taken, index == count, slot, start, end - start,
                                     self.copier.chunk_ready(), taken))
        self.copier.finish()
        self._release(fjob)
        fjob.snapshot_finished(copied=True)


#: A run of slots is at most this many bytes: the flush starts once the first run is copied and ends
#: one run's write after the last copy, so runs are short next to a checkpoint (a 12 GB rank: about
#: a hundred runs, a few GIL takes each); at 1 GiB the first write waited for half a 1 GB state's
#: copy and the flush ran at 0.6 of the O_DIRECT write (docs/history/BENCHMARKS-to-2026-12.md, "bench engine").
MAX_RUN_BYTES = 128 << 20


def run_slots(cache: HostCache) -> int:
    """How many slots one run may take: half the cache (so the copy of one run overlaps the checksum and
    write of the other), at most ``MAX_RUN_BYTES``, at least one slot."""
    return max(1, min(cache.num_slots // 2, MAX_RUN_BYTES // cache.chunk_bytes))
