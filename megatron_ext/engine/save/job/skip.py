"""``SkipRecord``: why a checkpoint was skipped under overload, and by which rank. Frozen: the
training thread, the snapshot thread and the committer read it from the job without a lock; the
commit's status (``commit.records.RankStatus.skipped``), the skip notice, the skip report and the
telemetry line are made from it."""

from __future__ import annotations

import dataclasses


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

    def report(self, rank: int, run_id: str, version: int | None) -> dict:
        """The skip report's content (``format.names.skip_report_name``)."""
        return {"rank": rank, "run_id": run_id, "version": version, **self.fields()}


__all__ = ["SkipRecord"]
