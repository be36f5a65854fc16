"""Overload: what a save does when the host cache is full, and skipping a checkpoint on every rank.

Under ``overload_policy="wait"`` a full cache is backpressure (``wait_snapshot`` waits). Under
"supersede" a newer save drops older checkpoints whose flush has not started; the rank that
decides posts ``skipped`` to the commit store (and leaves a skip report for ``inspect``), rank 0
decides ``skipped``, and every other rank abandons the same checkpoint. The durable-age
bound (``max_durable_age``) turns a save back to "wait" when the newest durable one is too old.

Each thread has its own part, so no module is called from three threads: ``Skips`` here is the
training thread's (a new checkpoint's policy, ``wait_snapshot``'s wait, the skips decided then);
the snapshot thread's is ``SkipSettler`` (skip_settle.py: superseding when the cache is full,
the notice, the report and the file removal); the committer's is a peer's skip that rank 0
decided (commit.py). A skip decided here is handed to the snapshot thread to settle
(``SnapshotScheduler.settle_later``).
"""

from __future__ import annotations

import time
from typing import Callable

from ..config import EngineConfig, OverloadPolicy
from ..errors import CheckpointError
from ..host_cache import HostCache
from .context import SaveContext
from .coordination import CommitChannel
from .job_table import JobTable
from .jobs import CheckpointJob, FileJob, JobState
from .records import SkipRecord, job_key
from .signal import CommitSignal
from .snapshot import SnapshotScheduler

#: Where this rank may still decide a skip itself: before it reports.
_UNREPORTED = frozenset({JobState.OPEN, JobState.FLUSHING})
#: Where a peer's skip still abandons it here: anything short of committed.
_UNCOMMITTED = frozenset({JobState.OPEN, JobState.FLUSHING, JobState.REPORTED})


class Skips:
    """The training thread's overload and skip decisions (see the module docstring)."""

    def __init__(self, ctx: SaveContext, config: EngineConfig, jobs: JobTable, cache: HostCache,
                 scheduler: SnapshotScheduler, channel: CommitChannel, signal: CommitSignal,
                 newest_committed: Callable[[], int | None]):
        self.ctx = ctx
        self.rank = ctx.rank
        self.overload_policy = config.overload_policy
        self.max_durable_age = config.max_durable_age
        self.jobs = jobs
        self.cache = cache
        self.scheduler = scheduler  # which copy is starved; settles what is skipped here (``settle_later``)
        self.channel = channel
        self.signal = signal  # the committer: a skipped checkpoint is settled without waiting for its files
        self._newest_committed = newest_committed  # the committer's: newest version committed in this run
        # Calls of wait_snapshot that waited for the flush to free cache space, and how long;
        # saves the durable-age bound turned from supersede to wait.
        self.backpressure_waits = 0
        self.backpressure_wait_s = 0.0
        self.age_bound_waits = 0
        self._first_version: int | None = None

    @property
    def newest_durable(self) -> int | None:
        """The newest version committed in this run (the committer's record)."""
        return self._newest_committed()

    def new_job(self, root: str, checkpoint: str, version: int | None, tag: str) -> CheckpointJob:
        """A new checkpoint's job, with its overload policy; under "supersede" it replaces older
        snapshots still waiting for cache space, and drops what another rank already skipped."""
        policy = self._policy_for(version)
        if policy == OverloadPolicy.SUPERSEDE:
            self._drop_peer_skipped()
        if self._first_version is None:
            self._first_version = version
        job = CheckpointJob(checkpoint=checkpoint, root=root, version=version, tag=tag, policy=policy)
        if policy == OverloadPolicy.SUPERSEDE:
            self._supersede_queued(job)
        if policy == OverloadPolicy.WAIT and self.overload_policy == OverloadPolicy.SUPERSEDE:
            self.age_bound_waits += 1
        return job

    def await_snapshots(self, pending: list[FileJob], deadline: float) -> None:
        """``wait_snapshot``'s wait: each pending copy done, or under "supersede" skipped if it waits for space.

        A copy waiting for cache space under "wait" is backpressure: counted, and waited for.
        """
        waited_for_flush = False
        for fjob in pending:
            waited_for_flush |= self._await_snapshot(fjob, deadline)
        self.backpressure_waits += waited_for_flush

    def _await_snapshot(self, fjob: FileJob, deadline: float) -> bool:
        """One file's copy done (or skipped); True if it waited for the flush to free space.

        Sleeps on the job's condition: the snapshot thread wakes it when the copy finishes or
        starts waiting for space, the failure handler when anything fails.
        """
        job = fjob.job
        waited_for_flush = False
        while True:
            seen = job.changes()
            if fjob.snapshot_done.is_set():
                return waited_for_flush
            self.ctx.check()
            starved = self.scheduler.starved is fjob
            ends = self.scheduler.slot_wait.ends_on_tie(deadline) if starved else deadline
            if time.monotonic() > ends:
                cause = ("its copy waits for a free host-cache slot, and the flush freed none (backpressure)"
                         if starved else "its copy is still running")
                raise CheckpointError(f"snapshot of {job.checkpoint} did not finish in time (timeout): {cause}")
            if starved and job.policy == OverloadPolicy.SUPERSEDE:
                self._skip(job, "no_cache_space")
                self.cache.wake()  # the copy gives up at once and releases the tensors
                job.wait_change(seen, ends - time.monotonic())
                continue
            t0 = time.monotonic()
            job.wait_change(seen, ends - t0 + 0.001)
            if starved:
                waited_for_flush = True
                self.backpressure_wait_s += time.monotonic() - t0

    def _policy_for(self, version: int | None) -> OverloadPolicy:
        """This new checkpoint's policy: the configured one, unless the durable-age bound forces a wait."""
        if self.overload_policy != OverloadPolicy.SUPERSEDE or self.max_durable_age is None:
            return OverloadPolicy(self.overload_policy)
        if version is None:
            raise CheckpointError("max_durable_age needs a version on every save (pass version=)")
        first = version if self._first_version is None else self._first_version
        newest = self.newest_durable
        newest = newest if newest is not None else first - 1
        return OverloadPolicy.WAIT if version - newest > self.max_durable_age else OverloadPolicy.SUPERSEDE

    def _supersede_queued(self, newer: CheckpointJob) -> None:
        """A new save while the snapshot thread waits for cache space: older snapshots not done are dropped.

        They are queued behind the full cache (or are the copy waiting in it); the newer state
        replaces them, so neither the copy thread nor a later ``wait_snapshot`` waits for them.
        """
        if self.scheduler.starved is None:
            return
        for job in self.jobs.jobs():
            if job is not newer and not all(f.snapshot_done.is_set() for f in job.files):
                self._skip(job, "superseded", superseded_by=newer)
        self.cache.wake()

    def _drop_peer_skipped(self) -> None:
        """Drop in-flight checkpoints another rank skipped, so their flush does not delay newer ones."""
        for job in self.jobs.jobs():
            if not job.abandoned and not job.settled.is_set():
                detail = self.channel.peer_skip(job_key(job))
                if detail is not None and detail.get("rank") != self.rank:
                    self._record(job, SkipRecord.from_peer(detail), _UNCOMMITTED)

    def _skip(self, job: CheckpointJob, reason: str, superseded_by: CheckpointJob | None = None) -> bool:
        """Decide here to abandon ``job`` (never committed, files removed); False if too late for that.

        Allowed only before this rank reported the checkpoint; its ``skipped`` status then makes
        every other rank abandon it too.
        """
        record = SkipRecord(reason, self.rank, superseded_by.checkpoint if superseded_by else None,
                            superseded_by.version if superseded_by else None)
        return self._record(job, record, _UNREPORTED)

    def _record(self, job: CheckpointJob, record: SkipRecord, allowed_from: frozenset[JobState]) -> bool:
        """The skip, if still allowed: telemetry, then the snapshot thread settles it, and the committer is told."""
        if not job.skip(record, allowed_from=allowed_from):
            return False
        self.ctx.telemetry.emit("skipped", job.checkpoint, "all", job.nbytes, version=job.version, **record.fields())
        self.scheduler.settle_later(job)
        self.signal.notify()
        return True


__all__ = ["Skips"]
