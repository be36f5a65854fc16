"""The checkpoints one rank has open in this run: a ``CheckpointJob`` per (root, checkpoint id).

Every rank saves and commits the same checkpoints in the same order (training is SPMD), so what
this table derives from that order is the same on every rank without a word exchanged: the
commit order the committer settles in, and the tag of a checkpoint id saved again in one run.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable

from .jobs import CheckpointJob


def attempt_tag(run_id: str, checkpoint: str, attempt: int) -> str:
    """The tag of the ``attempt``-th save of ``checkpoint`` in run ``run_id`` (0: the run id itself).

    Every rank derives the same tag, so a checkpoint id saved again in one run (Megatron-LM does,
    on a batch-size ramp-up step or for its rerun state machine) gets new file names: the files
    of the committed attempt stay untouched until the new manifest replaces the old one.
    """
    if attempt == 0:
        return run_id
    return hashlib.sha1(f"{run_id}/{checkpoint}/{attempt}".encode()).hexdigest()[:12]


class JobTable:
    """Open checkpoint jobs by (root, checkpoint); finished ones are kept only as ids (a run may take 100,000)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.open: dict[tuple[str, str], CheckpointJob] = {}
        self._committed_ids: set[tuple[str, str]] = set()  # committed in this run (saving again: a new attempt)
        self._attempts: dict[tuple[str, str], int] = {}  # checkpoints saved more than once in this run
        self._commit_seq = itertools.count()

    def jobs(self) -> list[CheckpointJob]:
        """A snapshot of the open jobs (other threads may read the table while the caller adds)."""
        return list(self.open.values())

    def add(self, job: CheckpointJob) -> CheckpointJob:
        self.open[(job.root, job.checkpoint)] = job
        return job

    def reusable(self, root: str, checkpoint: str,
                 wait_earlier: Callable[[CheckpointJob], None]) -> CheckpointJob | None:
        """The job still open for new files of ``checkpoint``, or None (then the caller starts one).

        A checkpoint already committed, or whose commit was requested, in this run is saved again
        as a new attempt: first the earlier attempt is waited for (``wait_earlier``: its commit
        stays valid until the new one replaces it), then the new attempt gets its own tag.
        """
        key = (root, checkpoint)
        self.forget_finished()
        job = self.open.get(key)
        if job is not None and not job.commit_requested:
            return job
        if job is None and key not in self._committed_ids:
            return None
        if job is not None:
            wait_earlier(job)
        self._committed_ids.discard(key)
        self._attempts[key] = self._attempts.get(key, 0) + 1
        return None

    def tag(self, root: str, checkpoint: str) -> str:
        """The tag of the attempt at ``checkpoint`` a new job starts (the run id, unless saved again)."""
        return attempt_tag(self.run_id, checkpoint, self._attempts.get((root, checkpoint), 0))

    def request_commit(self, job: CheckpointJob, on_committed: Callable[[Any], None] | None = None,
                       keep_last: int | None = None, retain: bool = False) -> bool:
        """Mark ``job`` for commit; True the first time (then it got its place in the commit order,
        in which the committer settles checkpoints)."""
        return job.request_commit(lambda: next(self._commit_seq), on_committed, keep_last, retain)

    def forget_finished(self) -> None:
        """Drop the records of finished checkpoints, keeping only their ids."""
        for key, job in list(self.open.items()):
            if job.settled.is_set():
                del self.open[key]
                self._committed_ids.add(key)

    def in_flight(self, root: str) -> set[str]:
        """Checkpoints under ``root`` saved or committing, not settled yet."""
        return {j.checkpoint for j in self.jobs() if j.root == root and not j.settled.is_set()}


__all__ = ["JobTable", "attempt_tag"]
