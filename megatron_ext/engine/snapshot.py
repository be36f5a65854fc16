"""The snapshot scheduler: copies each saved file's bytes into host-cache slots, in order.

One background thread takes ``FileJob``s first-in first-out, cuts each file's byte stream (header,
then tensors) into chunks of the cache's slot size, waits for a free slot (backpressure), copies,
and hands the filled slot to the flusher at once, so writing starts with the first chunk rather
than after the whole snapshot. When a file's last chunk is copied its tensors are released and
``snapshot_done`` is set; ``wait_snapshot`` waits on those events.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from .copier import CpuCopier
from .host_cache import HostCache
from .jobs import FileJob
from .worker import QueueWorker


@dataclasses.dataclass(eq=False)
class Chunk:
    """A filled cache slot: bytes [offset, offset + nbytes) of ``job``'s tensor file."""

    job: FileJob
    index: int
    last: bool
    slot: int
    offset: int
    nbytes: int
    ready: Callable[[], None]  # blocks until the slot's bytes are really there (CUDA event)


class SnapshotScheduler(QueueWorker):
    def __init__(self, cache: HostCache, copier: CpuCopier, emit: Callable[[Chunk], None],
                 fail: Callable[[BaseException], None], check: Callable[[], None], slot_timeout_s: float):
        self.cache = cache
        self.copier = copier
        self.emit = emit
        self.fail = fail
        self.check = check
        self.slot_timeout_s = slot_timeout_s
        self._dead = False
        self.start("datastates-snapshot")

    def handle(self, job: FileJob) -> None:
        if self._dead:  # after a failure nothing more is copied; waiters wake up and see the error
            job.snapshot_done.set()
            return
        try:
            self._copy_file(job)
        except BaseException as exc:
            self._dead = True
            self.fail(exc, None)  # the copy path is shared by all checkpoints: always fatal
            job.snapshot_done.set()

    def _copy_file(self, job: FileJob) -> None:
        layout = job.layout
        chunk = self.cache.chunk_bytes
        self.copier.begin(job.cuda_mark)
        sources = []
        for s in layout.slots:
            src = self.copier.prepare(s.tensor)
            if src is not s.tensor:
                job.keepalive.append(src)
            sources.append(src)
        seg = 0  # first tensor that may overlap the current chunk (tensors are in file order)
        count = job.num_chunks(chunk)
        for index in range(count):
            start = index * chunk
            end = min(start + chunk, layout.size)
            slot = self.cache.acquire(self.slot_timeout_s, self.check)
            dst = self.cache.view(slot)
            if start < layout.data_start:
                head = layout.header[start:min(end, layout.data_start)]
                self.cache.memory(slot, len(head))[:] = head
            while seg < len(layout.slots) and layout.slots[seg].end <= start:
                seg += 1
            k = seg
            while k < len(layout.slots) and layout.slots[k].start < end:
                s = layout.slots[k]
                lo, hi = max(s.start, start), min(s.end, end)
                if hi > lo:
                    self.copier.copy(sources[k], lo - s.start, hi - s.start, dst[lo - start:hi - start])
                k += 1
            self.emit(Chunk(job, index, index == count - 1, slot, start, end - start, self.copier.chunk_ready()))
        self.copier.finish()
        for s in layout.slots:  # the checkpoint now holds the values; let the caller's tensors go
            s.tensor = None
        job.keepalive.clear()
        job.snapshot_at = time.monotonic()
        job.snapshot_done.set()
