"""The snapshot thread's part of overload skips: superseding older checkpoints when the cache is
full, and settling a skipped checkpoint once no copy of it is left in progress.

Only the snapshot thread calls ``SkipSettler``: skips decided on the training thread (skips.py)
or the committer (a peer's skip) reach it as a ``SettleSkip`` in the scheduler's queue, so the
skip notice, the skip report and the ``Discard`` behind the checkpoint's last chunk are made in
one place, in queue order, and never cost the training thread a store call or a file write.
"""

from __future__ import annotations

import os

from ..files import atomic_write_json
from ..format.names import REPORTS
from .context import SaveContext
from .coordination import CommitChannel
from .flush import RankWriter
from .job_table import JobTable
from .jobs import CheckpointJob, JobState
from .messages import Discard
from .records import SkipRecord, job_key, skip_report_name
from .signal import CommitSignal

#: Where the snapshot thread may still supersede a checkpoint: before its flush started.
UNFLUSHED = frozenset({JobState.OPEN})


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
            if job.skip(record, allowed_from=UNFLUSHED):
                self.writer.take_back(job)
                self.ctx.telemetry.emit("skipped", job.checkpoint, "all", job.nbytes, version=job.version,
                                        **record.fields())
                self.settle(job)
                self.signal.notify()

    def settle(self, job: CheckpointJob) -> None:
        """Once every file of a skipped checkpoint is done with: tell the peers, leave the report, drop its files."""
        if job.skipped is None or not all(f.snapshot_done.is_set() for f in job.files):
            return
        if not job.advance(JobState.DISCARDED):
            return  # settled already
        if job.skipped.by_rank == self.rank:
            self.channel.notify_skip(job_key(job), job.skipped.fields())  # the others drop it before the decision
            reports = os.path.join(job.root, job.checkpoint, REPORTS)  # the record, for inspect
            os.makedirs(reports, exist_ok=True)
            atomic_write_json(os.path.join(reports, skip_report_name(self.rank, job.tag)),
                              job.skipped.report(self.rank, job.tag, job.version))
        self.writer.submit(Discard(job))  # behind the checkpoint's last chunk: removes its files


__all__ = ["SkipSettler", "UNFLUSHED"]
