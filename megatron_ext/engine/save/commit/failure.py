"""What a background failure does to one rank's engine and to the checkpoints it had open.

Any stage thread calls ``fail``; the training thread learns of it at its next engine call
(``check``), and every wait re-checks it, so no failure waits for a timeout to surface. A fatal
failure stops the engine and fails every open checkpoint on every rank at once, through the
commit store. Under ``on_failure="continue"`` a failure that belongs to one checkpoint only
abandons that checkpoint; the committer then posts it as failed, in its turn.
"""

from __future__ import annotations

import logging
import os
import threading

from ...config import OnFailure
from ...errors import CheckpointError
from ...format.names import REPORTS, report_name
from ...telemetry import Telemetry
from ..flow.io_ops import write_record
from ..job.jobs import CheckpointJob
from ..job.signal import CommitSignal
from ..job.table import JobTable
from ..lifecycle.space import shortfall_note
from .coordination import CommitChannel
from .records import CommitDecision, RankStatus, job_key

log = logging.getLogger("megatron_ext.engine")


class FailureHandler:
    """The first fatal background failure of a rank (``error``), and how each failure is spread."""

    def __init__(self, rank: int, run_id: str, on_failure: str, jobs: JobTable, telemetry: Telemetry,
                 channel: CommitChannel, signal: CommitSignal):
        self.rank, self.run_id, self.on_failure = rank, run_id, on_failure
        self.jobs, self.telemetry = jobs, telemetry
        self.channel = channel  # tells the other ranks that an open checkpoint failed here
        self.signal = signal  # wakes the committer, which settles what failed
        self.error: BaseException | None = None
        self.note = ""  # said after the first fatal failure: the space a full file system lacked
        self._lock = threading.Lock()

    def fail(self, exc: BaseException, job: CheckpointJob | None = None) -> bool:
        """A background thread failed (``job``: the checkpoint it belongs to, if only one).

        Returns True if the engine must stop; from then on every engine call raises.
        """
        fatal = job is None or self.on_failure == OnFailure.STOP
        note = shortfall_note(exc, job.root, job.nbytes) if job is not None else ""  # a full file system: by how much
        message = f"{type(exc).__name__}: {exc}{note}"
        with self._lock:
            if fatal and self.error is None:
                self.error, self.note = exc, note
        if job is not None:
            job.fail(exc)
        for target in self.jobs.jobs():  # every wait re-checks now (a wait on any job may raise this failure)
            target.wake()
        for target in [job] if job is not None else self.jobs.jobs():
            self._write_error_report(target, message)
        if fatal:  # this rank settles nothing any more: every open checkpoint fails, on every rank, now
            for target in self.jobs.jobs():
                if not target.settled.is_set():
                    try:
                        self._post_failed(target, message)
                    except Exception as store_exc:  # the others then time out, naming this rank
                        log.error("[datastates] rank %d: could not tell the other ranks of the failure: %s",
                                  self.rank, store_exc)
        else:
            log.error("[datastates] rank %d: checkpoint %s abandoned, training continues: %s",
                      self.rank, job.checkpoint, message)
            self.telemetry.emit("failed", job.checkpoint, "all", job.nbytes, error=message)
        self.signal.notify()
        return fatal

    def _post_failed(self, job: CheckpointJob, message: str) -> None:
        """From any thread, once the engine failed: ``job`` will not be committed by this rank.

        The other ranks learn it from rank 0's decision; rank 0 itself decides at once (its
        committer thread may be gone).
        """
        key = job_key(job)
        if job.claim_status():
            self.channel.post(key, RankStatus.failed(message).wire(), from_committer=False)
        if self.channel.leads and job.claim_forward():  # this rank's group would wait for its committer
            self.channel.forward_failed(key, RankStatus.failed(message).wire())
        if self.rank == 0:
            self.channel.settle(key, CommitDecision.failed(f"checkpoint {job.checkpoint} failed on rank 0: {message}").wire())

    def _write_error_report(self, job: CheckpointJob, message: str) -> None:
        """The record of the failure in the checkpoint's reports, for ``inspect``; the other
        ranks learn of it through the commit store, not from this file."""
        try:
            reports = os.path.join(job.root, job.checkpoint, REPORTS)
            write_record(os.path.join(reports, report_name(self.rank, self.run_id, error=True)),
                         {"rank": self.rank, "run_id": self.run_id, "error": message})
        except OSError:
            pass  # the file system itself may be what failed; the error stands without its record

    def check(self) -> None:
        """Raise, on the caller's thread, the first fatal failure of a background thread (cheap)."""
        if self.error is not None:
            raise CheckpointError(f"background checkpointing failed on rank {self.rank}: "
                                  f"{type(self.error).__name__}: {self.error}{self.note}") from self.error


__all__ = ["FailureHandler"]
