"""Overload: what a save does when the host cache is full, and skipping a checkpoint on every rank.

Under ``overload_policy="wait"`` a full cache is backpressure (``wait_snapshot`` waits). Under
"supersede" a newer save drops older checkpoints whose flush has not started; the rank that
decides posts ``skipped`` to the commit store (and leaves a skip report for ``inspect``), rank 0
decides ``skipped``, and every other rank abandons the same checkpoint. The durable-age
bound (``max_durable_age``) turns a save back to "wait" when the newest durable one is too old.

This module is the only caller of ``CheckpointJob.skip`` and the only writer of the "skipped"
telemetry (``_record``). Each thread has its own part, so no part is called from two threads:
``Skips`` is the training thread's (a new checkpoint's policy, ``wait_snapshot``'s wait, the skips
decided then); ``SkipSettler`` the snapshot thread's (superseding when the cache is full, the notice,
the report and the file removal); ``PeerSkips`` the committer's (a peer's skip that rank 0 decided).
A skip decided on the training thread or the committer is handed to the snapshot thread to settle
(``SnapshotScheduler.settle_later``), so the notice, the report and the ``Discard`` behind the
checkpoint's last chunk are made in one place, in queue order, and never cost the training thread a
store call or a file write.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from ..config import EngineConfig, OverloadPolicy
from ..errors import CheckpointError
from ..format.names import REPORTS, skip_report_name
from ..host_cache import HostCache
from ..telemetry import Telemetry
from .commit.coordination import CommitChannel
from .commit.records import job_key
from .context import SaveContext
from .flow.flush import RankWriter
from .flow.snapshot import SnapshotScheduler
from .job.jobs import CheckpointJob, FileJob, JobState
from .job.messages import Discard
from .job.signal import CommitSignal
from .job.skip import SkipRecord
from .job.table import JobTable

#: Where the snapshot thread may still supersede a checkpoint: before its flush started.
UNFLUSHED = frozenset({JobState.OPEN})
#: Where this rank may still decide a skip itself: before it reports.
UNREPORTED = frozenset({JobState.OPEN, JobState.FLUSHING})
#: Where a peer's skip still abandons it here: anything short of committed.
UNCOMMITTED = frozenset({JobState.OPEN, JobState.FLUSHING, JobState.REPORTED})


def _record(telemetry: Telemetry, job: CheckpointJob, record: SkipRecord, allowed_from: frozenset[JobState]) -> bool:
    """The skip, if ``job`` is still in one of ``allowed_from``: its state, then its telemetry line."""
    if not job.skip(record, allowed_from=allowed_from):
        return False
    telemetry.emit("skipped", job.checkpoint, "all", job.nbytes, version=job.version, **record.fields())
    return True


def _record_elsewhere(telemetry: Telemetry, scheduler: SnapshotScheduler, signal: CommitSignal, job: CheckpointJob,
                      record: SkipRecord, allowed_from: frozenset[JobState]) -> bool:
    """A skip decided off the snapshot thread (training thread, committer): recorded, handed to the
    snapshot thread to settle, and the committer told."""
    if not _record(telemetry, job, record, allowed_from):
        return False
    scheduler.settle_later(job)
    signal.notify()
    return True


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
                record = self.channel.peer_skip(job_key(job))
                if record is not None:
                    self._record(job, record, UNCOMMITTED)

    def _skip(self, job: CheckpointJob, reason: str, superseded_by: CheckpointJob | None = None) -> bool:
        """Decide here to abandon ``job`` (never committed, files removed); False if too late for that.

        Allowed only before this rank reported the checkpoint; its ``skipped`` status then makes
        every other rank abandon it too.
        """
        record = SkipRecord(reason, self.rank, superseded_by.checkpoint if superseded_by else None,
                            superseded_by.version if superseded_by else None)
        return self._record(job, record, UNREPORTED)

    def _record(self, job: CheckpointJob, record: SkipRecord, allowed_from: frozenset[JobState]) -> bool:
        return _record_elsewhere(self.ctx.telemetry, self.scheduler, self.signal, job, record, allowed_from)


class SkipSettler:
    """Supersedes and settles skipped checkpoints, on the snapshot thread (see the module docstring)."""

    def __init__(self, ctx: SaveContext, jobs: JobTable, writer: RankWriter, channel: CommitChannel,
                 signal: CommitSignal):
        self.ctx = ctx
        self.rank = ctx.rank
        self.jobs = jobs
        self.writer = writer  # removes a skipped checkpoint's files, behind its chunks (``Discard``)
        self.channel = channel  # the skip notice: the other ranks drop it before rank 0's decision
        self.signal = signal  # the committer: a skipped checkpoint is settled without waiting for its files

    def supersede_older(self, newer: CheckpointJob) -> None:
        """Cache full under "supersede": drop older checkpoints whose flush has not started."""
        for job in self.jobs.jobs():
            if job is newer:
                return
            if job.settled.is_set() or not all(f.snapshot_done.is_set() for f in job.files):
                continue
            record = SkipRecord("superseded", self.rank, newer.checkpoint, newer.version)
            if _record(self.ctx.telemetry, job, record, UNFLUSHED):
                self.writer.take_back(job)
                self.settle(job)
                self.signal.notify()

    def settle(self, job: CheckpointJob) -> None:
        """Once every file of a skipped checkpoint is done with: tell the peers, leave the report, drop its files."""
        if job.skipped is None or not all(f.snapshot_done.is_set() for f in job.files):
            return
        if not job.advance(JobState.DISCARDED):
            return  # settled already
        report = None
        if job.skipped.by_rank == self.rank:
            self.channel.notify_skip(job_key(job), job.skipped)  # the others drop it before the decision
            reports = os.path.join(job.root, job.checkpoint, REPORTS)  # the record, for inspect
            report = (os.path.join(reports, skip_report_name(self.rank, job.tag)),
                      job.skipped.report(self.rank, job.tag, job.version))
        self.writer.submit(Discard(job, report))  # behind the checkpoint's last chunk: removes its files


class PeerSkips:
    """The committer's part: rank 0 decided that another rank skipped a checkpoint."""

    def __init__(self, telemetry: Telemetry, scheduler: SnapshotScheduler, signal: CommitSignal):
        self.telemetry = telemetry
        self.scheduler = scheduler  # removes this rank's files of it (``settle_later``)
        self.signal = signal

    def abandon(self, job: CheckpointJob, report: dict) -> None:
        """Drop ``job`` here as well (``report``: the skipping rank's, from rank 0's decision), short of committed."""
        _record_elsewhere(self.telemetry, self.scheduler, self.signal, job, SkipRecord.from_peer(report), UNCOMMITTED)


__all__ = ["PeerSkips", "SkipSettler", "Skips", "UNCOMMITTED", "UNFLUSHED", "UNREPORTED"]
