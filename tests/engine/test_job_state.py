"""``CheckpointJob``'s one state: the moves that exclude each other are decided by ``advance`` under
the job's own lock (a skip after the report is refused, a late peer skip after the commit too)."""

from __future__ import annotations

from megatron_ext.engine.save.commit.records import RankStatus
from megatron_ext.engine.save.job.jobs import CheckpointJob, JobState
from megatron_ext.engine.save.job.skip import SkipRecord

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


def test_a_wait_is_told_when_the_writer_publishes_durability_and_the_committer_settles():
    """``wait_settled`` sleeps on the job's condition: the writer's ``mark_durable`` and the
    committer's ``settle`` end it at once, well before ``RECHECK_S``."""
    import threading
    import time
    import types

    from megatron_ext.engine.format.names import LEVEL_SHARED
    from megatron_ext.engine.save.job.jobs import RECHECK_S

    job = _job()
    fjob = types.SimpleNamespace(durable_at={}, nbytes=0, sidecar=b"")
    job.add_file(fjob)
    threading.Timer(0.05, job.mark_durable, (fjob, LEVEL_SHARED)).start()
    started = time.monotonic()
    job.wait_settled(started + 30, lambda: None)
    assert LEVEL_SHARED in fjob.durable_at and time.monotonic() - started < RECHECK_S
    assert job.request_commit(lambda: 7) and not job.request_commit(lambda: 8) and job.commit_seq == 7
    threading.Timer(0.05, job.settle).start()
    started = time.monotonic()
    job.wait_settled(started + 30, lambda: None)
    assert job.settled.is_set() and time.monotonic() - started < RECHECK_S


def test_a_failure_wakes_a_wait_and_is_raised_on_the_waiting_thread():
    import threading
    import time
    import types

    import pytest

    job = _job()
    job.add_file(types.SimpleNamespace(durable_at={}, nbytes=0, sidecar=b""))  # never durable
    failed = []

    def check():
        if failed:
            raise RuntimeError("background failure")

    def fail():
        failed.append(True)
        job.wake()  # what the failure handler does for every open job

    threading.Timer(0.05, fail).start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="background failure"):
        job.wait_settled(started + 30, check)
    assert time.monotonic() - started < 0.9


def test_the_work_queue_takes_back_what_the_predicate_accepts_in_order():
    from megatron_ext.engine.save.flow.worker import WorkQueue

    q = WorkQueue()
    for item in range(6):
        q.put(item)
    assert q.cancel(lambda i: i % 2 == 0) == [0, 2, 4] and q.cancel(lambda i: i > 10) == []
    assert [q.get() for _ in range(len(q))] == [1, 3, 5]


def test_the_commit_decision_and_skip_status_keep_the_store_json():
    from megatron_ext.engine.save.commit.records import CommitDecision

    skipped = CommitDecision.skipped({"rank": 2, "reason": "superseded"}, "checkpoint A skipped by rank 2: superseded")
    assert skipped.wire() == {"state": "skipped", "report": {"rank": 2, "reason": "superseded"},
                              "message": "checkpoint A skipped by rank 2: superseded"}
    assert CommitDecision.from_wire(skipped.wire()) == skipped
    assert CommitDecision.failed("boom").wire() == {"state": "failed", "error": "boom"}
    assert CommitDecision.from_wire({"state": "committed", "manifest": {"run_id": "r"}}).manifest == {"run_id": "r"}
    record = SkipRecord.from_peer({"rank": 3, "reason": "no_cache_space", "superseded_by": None})
    assert record.by_rank == 3 and RankStatus.skipped(record).wire() == {
        "state": "skipped", "reason": "skipped by rank 3: no_cache_space", "skipped_by": 3,
        "superseded_by": None, "superseded_by_version": None}
    collected = RankStatus.from_wire({**RankStatus.skipped(record).wire(), "rank": 3, "from": "a newer build"})
    assert collected.rank == 3 and collected.skip_report() == {
        "rank": 3, "reason": "skipped by rank 3: no_cache_space", "superseded_by": None, "superseded_by_version": None}
    assert RankStatus.from_wire({"state": "failed", "rank": 1, "error": "boom"}) == RankStatus("failed", 1, error="boom")
    assert RankStatus.from_wire({"state": "?", "rank": 2}).state == "failed"  # any state but skipped fails it


def test_a_committed_manifest_reads_the_disk_only_when_loaded(tmp_path):
    import pytest

    from megatron_ext.engine.errors import CheckpointError
    from megatron_ext.engine.read.entries import CommittedManifest

    manifest = CommittedManifest({"checkpoint": "A", "run_id": "0123456789ab", "version": 3, "world_size": 1},
                                 str(tmp_path / "A"))
    assert manifest.version == 3 and manifest["run_id"] == manifest.run_id and "files" not in manifest
    assert dict(manifest) == manifest.header()  # the header alone: nothing read
    with pytest.raises(CheckpointError, match="not the manifest rank 0 committed"):
        manifest.load()  # no manifest there
