"""Overload: what a save does when the host cache is full, and skipping a checkpoint on every rank.

Under ``overload_policy="wait"`` a full cache is backpressure (``wait_snapshot`` waits). Under
"supersede" a newer save drops older checkpoints whose flush has not started; the rank that
decides posts ``skipped`` to the commit store (and leaves a skip report for ``inspect``), rank 0
decides ``skipped``, and every other rank abandons the same checkpoint. The durable-age
bound (``max_durable_age``) turns a save back to "wait" when the newest durable one is too old.

``OverloadMixin`` is part of ``CheckpointEngine``: it shares the engine's state lock, job table,
writer and committer, so the decisions here exclude the flush starting and the rank reporting.
"""

from __future__ import annotations

import os
import time

from ..config import OverloadPolicy
from ..errors import CheckpointError, CheckpointSkipped
from ..files import atomic_write_json
from ..format.names import REPORTS
from .commit import job_key, skip_report_name
from .jobs import CheckpointJob
from .messages import Discard

_POLL_S = 0.05  # how often a wait re-checks for failures


class OverloadMixin:
    """The overload, supersede and skip decisions of ``CheckpointEngine`` (see the module docstring)."""

    def _init_overload(self) -> None:
        # Calls of wait_snapshot that waited for the flush to free cache space, and how long;
        # saves the durable-age bound turned from supersede to wait.
        self.backpressure_waits = 0
        self.backpressure_wait_s = 0.0
        self.age_bound_waits = 0
        self._newest_durable: int | None = None  # newest version committed in this run
        self._first_version: int | None = None

    def _new_job(self, root: str, checkpoint: str, version: int | None, tag: str) -> CheckpointJob:
        """A new checkpoint's job, with its overload policy; under "supersede" it replaces older
        snapshots still waiting for cache space, and drops what another rank already skipped."""
        policy = self._overload_policy_for(version)
        if policy == OverloadPolicy.SUPERSEDE:
            self._before_superseding_save()
        if self._first_version is None:
            self._first_version = version
        job = CheckpointJob(checkpoint=checkpoint, root=root, version=version, tag=tag, policy=policy)
        if policy == OverloadPolicy.SUPERSEDE:
            self._supersede_queued(job)
        if policy == OverloadPolicy.WAIT and self.config.overload_policy == OverloadPolicy.SUPERSEDE:
            self.age_bound_waits += 1
        return job

    def _await_snapshots(self, pending: list, deadline: float) -> None:
        """``wait_snapshot``'s wait: each pending copy done, or under "supersede" skipped if it waits for space.

        A copy waiting for cache space under "wait" is backpressure: counted, and waited for.
        """
        progress = self.scheduler.progress
        waited_for_flush = False
        for fjob in pending:
            while True:
                progress.clear()
                if fjob.snapshot_done.is_set():
                    break
                self.failures.check()
                if time.monotonic() > deadline:
                    raise CheckpointError(f"snapshot of {fjob.job.checkpoint} did not finish in time (timeout)")
                starved = self.scheduler.starved is fjob
                if starved and fjob.job.policy == OverloadPolicy.SUPERSEDE:
                    self._skip(fjob.job, "no_cache_space")
                    self.cache.wake()  # the copy gives up at once and releases the tensors
                    fjob.snapshot_done.wait(_POLL_S)
                    continue
                t0 = time.monotonic()
                progress.wait(_POLL_S)
                if starved:
                    waited_for_flush = True
                    self.backpressure_wait_s += time.monotonic() - t0
        self.backpressure_waits += waited_for_flush

    def _overload_policy_for(self, version: int | None) -> str:
        """This new checkpoint's policy: the configured one, unless the durable-age bound forces a wait."""
        if self.config.overload_policy != OverloadPolicy.SUPERSEDE or self.config.max_durable_age is None:
            return self.config.overload_policy
        if version is None:
            raise CheckpointError("max_durable_age needs a version on every save (pass version=)")
        first = version if self._first_version is None else self._first_version
        newest = self._newest_durable if self._newest_durable is not None else first - 1
        return OverloadPolicy.WAIT if version - newest > self.config.max_durable_age else OverloadPolicy.SUPERSEDE

    @property
    def newest_durable_version(self) -> int | None:
        """Version of the newest checkpoint committed in this run (what ``max_durable_age`` measures from)."""
        return self._newest_durable

    def _note_durable(self, manifest: dict) -> None:
        version = manifest.get("version")
        if version is not None and (self._newest_durable is None or version > self._newest_durable):
            self._newest_durable = version

    def _skip(self, job: CheckpointJob, reason: str, superseded_by: CheckpointJob | None = None,
              unstarted_only: bool = False) -> bool:
        """Decide here to abandon ``job`` (never committed, files removed); False if too late for that.

        Allowed only before this rank reported the checkpoint (and, with ``unstarted_only``,
        before its flush started); its ``skipped`` status then makes every other rank abandon it too.
        """
        with self._state_lock:
            if job.reported or (unstarted_only and any(f.flush_started for f in job.files)):
                return False
            info = {"reason": reason, "by_rank": self.rank,
                    "superseded_by": superseded_by.checkpoint if superseded_by else None,
                    "superseded_by_version": superseded_by.version if superseded_by else None}
            if not self._mark_skipped(job, info):
                return False
        self._after_skip(job)
        return True

    def _skip_for_peer(self, job: CheckpointJob, report: dict) -> None:
        """Another rank skipped ``job`` (its notice or rank 0's decision): abandon it here too, short of committed."""
        info = {"reason": f"skipped by rank {report.get('rank')}: {report.get('reason')}",
                "by_rank": report.get("rank"), "superseded_by": report.get("superseded_by"),
                "superseded_by_version": report.get("superseded_by_version")}
        with self._state_lock:
            if not self._mark_skipped(job, info):
                return
        self._after_skip(job)

    @staticmethod
    def _mark_skipped(job: CheckpointJob, info: dict) -> bool:
        """Under the state lock: record the skip unless the checkpoint is already settled."""
        if job.abandoned or job.committed.is_set():
            return False
        job.skipped = info
        return True

    def _after_skip(self, job: CheckpointJob) -> None:
        """Telemetry, then the skip notice and file removal once no copy of it is left in progress."""
        self.telemetry.emit("skipped", job.checkpoint, "all", job.nbytes, version=job.version, **job.skipped)
        self._settle_skipped(job)
        self.committer.poke()

    def _settle_skipped(self, job: CheckpointJob) -> None:
        """Once the scheduler is done with every file of a skipped checkpoint: tell the peers, drop its files.

        Runs on the snapshot thread (or the thread that skipped it, when all its copies were
        done), so the skip notice and report never cost the training thread a store call or file write.
        """
        if job.skipped is None or not all(f.snapshot_done.is_set() for f in job.files):
            return
        with self._state_lock:
            if job.discard_sent:
                return
            job.discard_sent = True
        if job.skipped["by_rank"] == self.rank:
            self.channel.notify_skip(job_key(job), job.skipped)  # the others drop it before the decision
            reports = os.path.join(job.root, job.checkpoint, REPORTS)  # the record, for inspect
            os.makedirs(reports, exist_ok=True)
            atomic_write_json(os.path.join(reports, skip_report_name(self.rank, job.tag)),
                              {"rank": self.rank, "run_id": job.tag, "version": job.version, **job.skipped})
        self.writer.submit(Discard(job))  # behind the checkpoint's last chunk: removes its files

    def _supersede_older(self, newer: CheckpointJob) -> None:
        """Snapshot thread, cache full: drop older checkpoints whose flush has not started."""
        for job in self.jobs.jobs():
            if job is newer:
                return
            if job.committed.is_set() or not all(f.snapshot_done.is_set() for f in job.files):
                continue
            if self._skip(job, "superseded", superseded_by=newer, unstarted_only=True):
                self.writer.take_back(job)

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

    def _abandon_for_peer(self, job: CheckpointJob, exc: CheckpointSkipped) -> None:
        """Committer thread: another rank skipped ``job``; drop it here as well."""
        self._skip_for_peer(job, exc.report)

    def _before_superseding_save(self) -> None:
        """Drop in-flight checkpoints another rank skipped, so their flush does not delay newer ones."""
        for job in self.jobs.jobs():
            if not job.abandoned and not job.committed.is_set():
                detail = self.channel.peer_skip(job_key(job))
                if detail is not None and detail.get("rank") != self.rank:
                    self._skip_for_peer(job, detail)


__all__ = ["OverloadMixin"]
