"""The records that cross threads or reach the commit store and the disk, frozen: a reader on
another thread (or rank) sees one whole value, never one being filled in.

``SkipRecord`` is why a checkpoint was skipped; ``CommitDecision`` is rank 0's verdict on one
checkpoint, the one every rank reports; ``FailedStatus`` is what a rank posts for a checkpoint it
failed. Each converts to and from the JSON the commit store carries (``wire``), which is unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .coordination import COMMITTED, FAILED, SKIPPED, checkpoint_key


def skip_report_name(rank: int, run_id: str) -> str:
    """The skip report a rank that skipped a checkpoint leaves in its ``.reports`` (for ``inspect``)."""
    return f"rank-{rank:05d}.{run_id}.skipped.json"


def job_key(job: Any) -> str:
    """The commit store's name for this attempt at ``job``'s checkpoint (a ``CheckpointJob``)."""
    return checkpoint_key(job.root, job.checkpoint, job.tag)


@dataclasses.dataclass(frozen=True)
class SkipRecord:
    """Why a checkpoint was skipped under overload, and by which rank (telemetry, notice, report, status)."""

    reason: str
    by_rank: int | None
    superseded_by: str | None = None
    superseded_by_version: int | None = None

    @classmethod
    def from_peer(cls, detail: dict) -> "SkipRecord":
        """Another rank's skip (its notice, or rank 0's decision's ``report``), as this rank records it."""
        return cls(reason=f"skipped by rank {detail.get('rank')}: {detail.get('reason')}", by_rank=detail.get("rank"),
                   superseded_by=detail.get("superseded_by"),
                   superseded_by_version=detail.get("superseded_by_version"))

    def fields(self) -> dict:
        """Its fields as JSON (telemetry, the skip notice, the skip report)."""
        return dataclasses.asdict(self)

    def status(self) -> dict:
        """The ``skipped`` status this rank posts to the commit store."""
        return {"state": SKIPPED, "reason": self.reason, "skipped_by": self.by_rank,
                "superseded_by": self.superseded_by, "superseded_by_version": self.superseded_by_version}

    def report(self, rank: int, run_id: str, version: int | None) -> dict:
        """The skip report's content (``skip_report_name``)."""
        return {"rank": rank, "run_id": run_id, "version": version, **self.fields()}


@dataclasses.dataclass(frozen=True)
class FailedStatus:
    """The ``failed`` status a rank posts for a checkpoint it will not commit."""

    error: str

    def wire(self) -> dict:
        return {"state": FAILED, "error": self.error}


@dataclasses.dataclass(frozen=True)
class CommitDecision:
    """Rank 0's verdict on one checkpoint: committed (the manifest's header), failed (why) or
    skipped (the first skipping rank's ``report`` and a message)."""

    state: str  # COMMITTED, FAILED or SKIPPED (coordination.py)
    error: str | None = None
    manifest: dict | None = None  # committed: the manifest's header
    report: dict | None = None  # skipped: {"rank", "reason", "superseded_by", "superseded_by_version"}
    message: str | None = None  # skipped: what the training thread is told

    @classmethod
    def committed(cls, header: dict) -> "CommitDecision":
        return cls(COMMITTED, manifest=header)

    @classmethod
    def failed(cls, error: str) -> "CommitDecision":
        return cls(FAILED, error=error)

    @classmethod
    def skipped(cls, report: dict, message: str) -> "CommitDecision":
        return cls(SKIPPED, report=report, message=message)

    @classmethod
    def from_wire(cls, doc: dict) -> "CommitDecision":
        """From the commit store's JSON (rank 0 may be another build: unknown keys are ignored)."""
        return cls(doc.get("state"), doc.get("error"), doc.get("manifest"), doc.get("report"), doc.get("message"))

    def wire(self) -> dict:
        """The commit store's JSON, as it always was: only the keys of its state."""
        if self.state == COMMITTED:
            return {"state": COMMITTED, "manifest": self.manifest}
        if self.state == SKIPPED:
            return {"state": SKIPPED, "report": self.report, "message": self.message}
        return {"state": self.state, "error": self.error}


__all__ = ["CommitDecision", "FailedStatus", "SkipRecord", "job_key", "skip_report_name"]
