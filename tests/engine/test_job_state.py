"""``CheckpointJob``'s one state: the moves that exclude each other are decided by ``advance`` under
the job's own lock (a skip after the report is refused, a late peer skip after the commit too)."""

from __future__ import annotations

from megatron_ext.engine.save.jobs import CheckpointJob, JobState
from megatron_ext.engine.save.records import SkipRecord

OWN_SKIP = frozenset({JobState.OPEN, JobState.FLUSHING})
PEER_SKIP = frozenset({JobState.OPEN, JobState.FLUSHING, JobState.REPORTED})


def _job() -> CheckpointJob:
    return CheckpointJob(checkpoint="A", root="/nowhere", version=1, tag="0123456789ab")


def test_the_first_flushed_chunk_forbids_superseding_but_not_a_skip():
    job = _job()
    assert job.begin_flush() and job.state is JobState.FLUSHING
    assert not job.skip(SkipRecord("superseded", 0), allowed_from=frozenset({JobState.OPEN}))
    assert job.skip(SkipRecord("no_cache_space", 0), allowed_from=OWN_SKIP) and job.abandoned
    assert not job.begin_flush()  # the writer drops its chunks from now on
    assert job.advance(JobState.DISCARDED) and not job.advance(JobState.DISCARDED)  # the discard is sent once


def test_a_report_wins_over_a_later_skip_of_this_rank_but_not_over_a_peers():
    job = _job()
    assert job.advance(JobState.REPORTED)
    assert not job.skip(SkipRecord("no_cache_space", 0), allowed_from=OWN_SKIP)
    assert job.skip(SkipRecord("skipped by rank 1", 1), allowed_from=PEER_SKIP)
    assert job.skipped == SkipRecord("skipped by rank 1", 1) and not job.advance(JobState.COMMITTED)


def test_a_committed_or_settled_job_is_never_skipped_and_a_failure_keeps_the_first_error():
    job = _job()
    assert job.advance(JobState.REPORTED) and job.advance(JobState.COMMITTED)
    assert not job.skip(SkipRecord("late", 1), allowed_from=PEER_SKIP) and not job.abandoned
    other = _job()
    other.settled.set()  # the engine stopped: the committer settled it unreported
    assert not other.skip(SkipRecord("late", 1), allowed_from=PEER_SKIP)
    first, second = OSError("first"), OSError("second")
    other.fail(first)
    other.fail(second)
    assert other.state is JobState.FAILED and other.error is first
    assert other.claim_status() and not other.claim_status()
