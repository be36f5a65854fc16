"""The records that reach the commit store, frozen: a reader on another thread (or rank) sees one
whole value, never one being filled in.

``RankStatus`` is what a rank posts for a checkpoint it will not commit (skipped, with the
``SkipRecord`` of why, or failed), and what rank 0 collects of it; ``CommitDecision`` is rank 0's
verdict on one checkpoint, the one every rank reports. Each converts to and from the JSON the commit
store carries (``wire``, unchanged; the JSON of a rank of another build is read leniently).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..job.skip import SkipRecord
from .coordination import COMMITTED, FAILED, SKIPPED, checkpoint_key


def job_key(job: Any) -> str:
    """The commit store's name for this attempt at ``job``'s checkpoint (a ``CheckpointJob``)."""
    return checkpoint_key(job.root, job.checkpoint, job.tag)


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """A rank's status of a checkpoint it will not commit: ``SKIPPED`` (why, by whom, for which newer
    checkpoint) or ``FAILED`` (the error). ``rank`` is the poster's, which the channel adds on posting."""

    state: str
    rank: int | None = None
    reason: str | None = None
    skipped_by: int | None = None
    superseded_by: str | None = None
    superseded_by_version: int | None = None
    error: str | None = None

    @classmethod
    def skipped(cls, record: SkipRecord) -> "RankStatus":
        return cls(SKIPPED, reason=record.reason, skipped_by=record.by_rank, superseded_by=record.superseded_by,
                   superseded_by_version=record.superseded_by_version)

    @classmethod
    def failed(cls, error: str) -> "RankStatus":
        return cls(FAILED, error=error)

    @classmethod
    def from_wire(cls, doc: dict) -> "RankStatus":
        """As collected (the channel checked ``rank`` is an int); any state but ``SKIPPED`` counts as failed."""
        if doc.get("state") == SKIPPED:
            return cls(SKIPPED, doc["rank"], _text(doc.get("reason")), doc.get("skipped_by"),
                       _text(doc.get("superseded_by")), doc.get("superseded_by_version"))
        return cls(FAILED, doc["rank"], error=_text(doc.get("error")))

    def wire(self) -> dict:
        """The commit store's JSON, as it always was: only the keys of its state (the channel adds ``rank``)."""
        if self.state == SKIPPED:
            return {"state": SKIPPED, "reason": self.reason, "skipped_by": self.skipped_by,
                    "superseded_by": self.superseded_by, "superseded_by_version": self.superseded_by_version}
        return {"state": FAILED, "error": self.error}

    def skip_report(self) -> dict:
        """What rank 0's ``skipped`` decision carries of the first skipping rank (``SkipRecord.from_peer`` reads it)."""
        return {"rank": self.rank, "reason": self.reason, "superseded_by": self.superseded_by,
                "superseded_by_version": self.superseded_by_version}


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


__all__ = ["CommitDecision", "RankStatus", "job_key"]
