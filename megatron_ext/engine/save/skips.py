"""Overload: what a save does when the host cache is full, and skipping a checkpoint on every rank.

Under ``overload_policy="wait"`` a full cache is backpressure (``wait_snapshot`` waits). Under
"supersede" a newer save drops older checkpoints whose flush has not started; the rank that
decides posts ``skipped`` to the commit store (and leaves a skip report for ``inspect``), rank 0
decides ``skipped``, and every other rank abandons the same checkpoint. The durable-age
bound (``max_durable_age``) turns a save back to "wait" when the newest durable one is too old.

``Skips`` owns that state (the copy starved of cache space, the counts, the newest durable
version) and those decisions. The engine builds it before the stages that consult it (the
snapshot scheduler, the committer) and hands it to them; it only reaches downstream: the writer,
which removes a skipped checkpoint's files, and the commit channel and signal.
"""

from __future__ import annotations

import os
import threading
import time

from ..config import EngineConfig, OverloadPolicy
from ..errors import CheckpointError, CheckpointSkipped
from ..files import atomic_write_json
from ..format.names import REPORTS
from ..host_cache import HostCache
from .commit import job_key, skip_report_name
from .context import SaveContext
from .coordination import CommitChannel
from .deadlines import StageDeadline
from .flush import RankWriter
from .job_table import JobTable
from .jobs import CheckpointJob, FileJob, JobState
from .messages import Discard
from .signal import CommitSignal

_POLL_S = 0.05  # how often a wait re-checks for failures

#: Where this rank may still decide a skip itself: before it reports (and, to supersede, before the flush).
_UNREPORTED = frozenset({JobState.OPEN, JobState.FLUSHING})
_UNFLUSHED = frozenset({JobState.OPEN})
#: Where a peer's skip still abandons it here: anything short of committed.
_UNCOMMITTED = frozenset({JobState.OPEN, JobState.FLUSHING, JobState.REPORTED})


class Skips:
    """The overload, supersede and skip decisions of one rank (see the module docstring)."""

    def __init__(self, ctx: SaveContext, config: EngineConfig, jobs: JobTable, cache: HostCache,
                 writer: RankWriter, channel: CommitChannel, signal: CommitSignal):
        self.ctx = ctx
        self.rank = ctx.rank
        self.overload_policy = config.overload_policy
        self.max_durable_age = config.max_durable_age
        self.jobs = jobs
        self.cache = cache
        self.writer = writer  # removes a skipped checkpoint's files, behind its chunks (``Discard``)
        self.channel = channel
        self.signal = signal  # the committer: a skipped checkpoint is settled without waiting for its files
        # Calls of wait_snapshot that waited for the flush to free cache space, and how long;
        # saves the durable-age bound turned from supersede to wait.
        self.backpressure_waits = 0
        self.backpressure_wait_s = 0.0
        self.age_bound_waits = 0
        self.newest_durable: int | None = None  # newest version committed in this run
        self._first_version: int | None = None
        #: The file whose copy waits for a free cache slot right now (backpressure), or None.
        self.starved: FileJob | None = None
        #: Set whenever a snapshot finishes or starts waiting for space, for ``await_snapshots``.
        self.progress = threading.Event()
        #: The starved copy's own bounded wait for cache space (held by the snapshot thread): on a near
        #: tie with ``wait_snapshot``'s deadline, the copy's error ("the flush is stuck") is the one raised.
        self.slot_wait = StageDeadline()

    # ------------------------------------------------------------------ the training thread
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
        """One file's copy done (or skipped); True if it waited for the flush to free space."""
        waited_for_flush = False
        while True:
            self.progress.clear()
            if fjob.snapshot_done.is_set():
                return waited_for_flush
            self.ctx.check()
            starved = self.starved is fjob
            if time.monotonic() > (self.slot_wait.ends_on_tie(deadline) if starved else deadline):
                cause = ("its copy waits for a free host-cache slot, and the flush freed none (backpressure)"
                         if starved else "its copy is still running")
                raise CheckpointError(f"snapshot of {fjob.job.checkpoint} did not finish in time (timeout): {cause}")
            if starved and fjob.job.policy == OverloadPolicy.SUPERSEDE:
                self._skip(fjob.job, "no_cache_space")
                self.cache.wake()  # the copy gives up at once and releases the tensors
                fjob.snapshot_done.wait(_POLL_S)
                continue
            t0 = time.monotonic()
            self.progress.wait(_POLL_S)
            if starved:
                waited_for_flush = True
                self.backpressure_wait_s += time.monotonic() - t0

    def _policy_for(self, version: int | None) -> str:
        """This new checkpoint's policy: the configured one, unless the durable-age bound forces a wait."""
        if self.overload_policy != OverloadPolicy.SUPERSEDE or self.max_durable_age is None:
            return self.overload_policy
        if version is None:
            raise CheckpointError("max_durable_age needs a version on every save (pass version=)")
        first = version if self._first_version is None else self._first_version
        newest = self.newest_durable if self.newest_durable is not None else first - 1
        return OverloadPolicy.WAIT if version - newest > self.max_durable_age else OverloadPolicy.SUPERSEDE

    def _supersede_queued(self, newer: CheckpointJob) -> None:
        """A new save while the snapshot thread waits for cache space: older snapshots not done are dropped.

        They are queued behind the full cache (or are the copy waiting in it); the newer state
        replaces them, so neither the copy thread nor a later ``wait_snapshot`` waits for them.
        """
        if self.starved is None:
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
                    self._skip_for_peer(job, detail)

    # ------------------------------------------------------------------ the snapshot thread
    def starving(self, fjob: FileJob | None) -> None:
        """``fjob``'s copy starts waiting for cache space (None: it got its slots)."""
        self.starved = fjob
        if fjob is not None:
            self.progress.set()

    def supersede_older(self, newer: CheckpointJob) -> None:
        """Cache full under "supersede": drop older checkpoints whose flush has not started."""
        for job in self.jobs.jobs():
            if job is newer:
                return
            if job.settled.is_set() or not all(f.snapshot_done.is_set() for f in job.files):
                continue
            if self._skip(job, "superseded", superseded_by=newer, unstarted_only=True):
                self.writer.take_back(job)

    def settle(self, job: CheckpointJob) -> None:
        """Once the scheduler is done with every file of a skipped checkpoint: tell the peers, drop its files.

        Runs on the snapshot thread (or the thread that skipped it, when all its copies were
        done), so the skip notice and report never cost the training thread a store call or file write.
        """
        if job.skipped is None or not all(f.snapshot_done.is_set() for f in job.files):
            return
        if not job.advance(JobState.DISCARDED):
            return  # another thread sent it already
        if job.skipped["by_rank"] == self.rank:
            self.channel.notify_skip(job_key(job), job.skipped)  # the others drop it before the decision
            reports = os.path.join(job.root, job.checkpoint, REPORTS)  # the record, for inspect
            os.makedirs(reports, exist_ok=True)
            atomic_write_json(os.path.join(reports, skip_report_name(self.rank, job.tag)),
                              {"rank": self.rank, "run_id": job.tag, "version": job.version, **job.skipped})
        self.writer.submit(Discard(job))  # behind the checkpoint's last chunk: removes its files

    # ------------------------------------------------------------------ the committer thread
    def abandon_for_peer(self, job: CheckpointJob, exc: CheckpointSkipped) -> None:
        """Rank 0 decided that another rank skipped ``job``: drop it here as well."""
        self._skip_for_peer(job, exc.report)

    def note_committed(self, manifest: dict) -> None:
        """A checkpoint committed: the durable-age bound measures from the newest version."""
        version = manifest.get("version")
        if version is not None and (self.newest_durable is None or version > self.newest_durable):
            self.newest_durable = version

    # ------------------------------------------------------------------ the decision itself
    def _skip(self, job: CheckpointJob, reason: str, superseded_by: CheckpointJob | None = None,
              unstarted_only: bool = False) -> bool:
        """Decide here to abandon ``job`` (never committed, files removed); False if too late for that.

        Allowed only before this rank reported the checkpoint (and, with ``unstarted_only``,
        before its flush started); its ``skipped`` status then makes every other rank abandon it too.
        """
        info = {"reason": reason, "by_rank": self.rank,
                "superseded_by": superseded_by.checkpoint if superseded_by else None,
                "superseded_by_version": superseded_by.version if superseded_by else None}
        if not job.skip(info, allowed_from=_UNFLUSHED if unstarted_only else _UNREPORTED):
            return False
        self._after_skip(job)
        return True

    def _skip_for_peer(self, job: CheckpointJob, report: dict) -> None:
        """Another rank skipped ``job`` (its notice or rank 0's decision): abandon it here too, short of committed."""
        info = {"reason": f"skipped by rank {report.get('rank')}: {report.get('reason')}",
                "by_rank": report.get("rank"), "superseded_by": report.get("superseded_by"),
                "superseded_by_version": report.get("superseded_by_version")}
        if job.skip(info, allowed_from=_UNCOMMITTED):
            self._after_skip(job)

    def _after_skip(self, job: CheckpointJob) -> None:
        """Telemetry, then the skip notice and file removal once no copy of it is left in progress."""
        self.ctx.telemetry.emit("skipped", job.checkpoint, "all", job.nbytes, version=job.version, **job.skipped)
        self.settle(job)
        self.signal.notify()


__all__ = ["Skips"]
