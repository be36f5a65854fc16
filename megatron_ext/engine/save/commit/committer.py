"""The commit protocol: the one place that decides when a checkpoint exists.

1. Each rank, once every file it saved under a checkpoint is durable on the shared level and the
   caller asked to commit, writes its *rank report* ``<ckpt>/.reports/rank-RRRRR.<run>.json``
   atomically (temp file, fsync, rename, directory fsync). With a node-local level, the same report
   also goes to the local directory, recording that the local copy is complete. Then it posts its
   status, ``durable`` with what its report lists, to the commit store (coordination.py).
2. Rank 0 waits for every rank's status, joins the shares of the manifest they carry (each rank
   encoded its own and held it, with its report, to the rules a loader applies:
   ``manifest.check_share``), once each arrived exactly as posted (``CommitChannel.open_shares``:
   a digest per rank, no JSON parsed but small heads), checks what spans ranks
   (``manifest.assemble_manifest``) and writes ``<ckpt>/manifest.json`` atomically. At scale the
   ranks are grouped (``CommitGroups``): each group's first rank does this joining and checking for
   its group and forwards one record, so rank 0's work grows with the groups, not the ranks. The manifest
   is the commit marker: a directory without one is not a checkpoint and is never loaded. A
   manifest a loader would refuse is never written: the checkpoint fails on every rank, naming
   the rank whose share broke a rule or was damaged, and nothing is deleted. Then it publishes
   its decision.
3. The other ranks wait for the decision. Callbacks (a framework's "latest" tracker) run only
   once the manifest is durable; on ranks other than 0 the file list is read from disk only if a callback asks for it.

No rank polls the file system: per checkpoint each writes O(1) files and makes O(1) store calls,
and rank 0 reads the N statuses in one call. A rank that fails posts ``failed`` (and leaves an
``rank-RRRRR.<run>.error.json`` for the record); a rank that skips a checkpoint under
``overload_policy="supersede"`` posts ``skipped`` (and leaves ``.skipped.json``). Rank 0 then
decides ``failed`` or ``skipped``, and every rank fails or abandons that checkpoint instead of
waiting out its timeout. A rank that never posts (dead) is named when rank 0's wait runs out.
Checkpoints are settled in the order their commits were requested, the same on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from ... import faults
from ...errors import CheckpointError, CheckpointSkipped
from ...format.catalog import manifest_exists
from ...format.manifest import MANIFEST_SHARES, assemble_manifest, encode_json, merge_summaries, summarize_heads
from ...format.names import LEVEL_HOST, LEVEL_LOCAL, LEVEL_SHARED, MANIFEST, REPORTS, report_name
from ...format.report import durable_share, rank_report
from ...format.validation import check_report
from ...object_store import is_object_url
from ...read.entries import CommittedManifest
from ...threads import CpuMeter, EngineThread
from ..context import SaveContext
from ..job.jobs import CheckpointJob, CommitOutcome, JobState
from ..job.signal import CommitSignal
from ..lifecycle.retention import remove_unlisted
from ..flow.io_ops import write_whole
from .coordination import COMMITTED, SKIPPED, Collected, CommitChannel, DecisionTimeout, ShareDamaged
from .records import CommitDecision, RankStatus, job_key

if TYPE_CHECKING:
    from ..flow.io_worker import IoChannel
    from ..lifecycle.retention import RetentionStage

#: Ranks other than 0 wait this much longer than rank 0 for the decision, so that when a rank is
#: missing, rank 0's timeout (which names it) comes first and reaches everyone. Rank 0's clock
#: starts when its own files are durable, which may be later still: a rank whose wait runs out
#: while rank 0 has posted (so rank 0 is alive and collecting) waits once more (``_await_decision``).
DECISION_GRACE_S = 30.0


def abandoned_status(job: CheckpointJob) -> dict:
    """What a rank posts for a checkpoint it will not commit (skipped or failed here)."""
    if job.skipped is not None:
        return RankStatus.skipped(job.skipped).wire()
    return RankStatus.failed(f"{type(job.error).__name__}: {job.error}").wire()


def job_report(job: CheckpointJob, rank: int, world_size: int) -> dict:
    """``job``'s rank report (``format.report.rank_report``) of this rank's files."""
    return rank_report(job.tag, rank, world_size, job.checkpoint, job.version, [f.report() for f in job.files])


def checked_report(job: CheckpointJob, rank: int, world_size: int) -> tuple[bytes, tuple[list, dict[str, bytes]]]:
    """``rank``'s report of ``job`` as its file's bytes, held to a loader's rules before it counts, and
    the durable share made of them: the one way the live commit and ``OfflineWriter`` report a rank."""
    report = job_report(job, rank, world_size)
    check_report(report, rank)
    data = encode_json(report)
    return data, durable_share(report, data, f"{job.checkpoint}/{REPORTS}/{report_name(rank, job.tag)}")


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection while rank 0 merges the ranks' statuses.

    The merge allocates O(ranks) small containers; each collection they trigger would scan the
    training process's whole heap (measured: 2x rank 0's CPU per commit at 4,096 ranks). Nothing
    cyclic is made here; a collection runs later as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Committer:
    """Background thread: rank reports and statuses, and on rank 0 the manifest and the decision.

    It sleeps on ``signal`` (signal.py), which the flush stages notify when a file is durable and
    the engine, the skips and the failure handler when anything else it waits for changed.

    A peer's skip that rank 0 decided goes to ``peer_skipped`` (``overload.PeerSkips.abandon``), on
    this thread; None (the commit bench's committers, which never skip) only settles the job.
    ``newest_committed`` is this thread's alone: the newest version committed in this run.
    """

    def __init__(self, ctx: SaveContext, *, channel: CommitChannel, signal: CommitSignal,
                 peer_skipped: Callable[[CheckpointJob, dict], None] | None = None,
                 may_remove: Callable[[str], bool] = lambda root: False,
                 retention: "RetentionStage | None" = None, io: "IoChannel | None" = None):
        self.ctx = ctx
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.run_id = ctx.run_id
        self.local_root = lambda job: ctx.directory(job, LEVEL_LOCAL)  # None without a node-local level
        self.telemetry = ctx.telemetry
        self.timeout_s = ctx.timeout_s
        self.fail = ctx.fail
        self.check = ctx.check
        self.channel = channel
        self.signal = signal
        self.peer_skipped = peer_skipped  # a peer skipped a checkpoint: drop it here too
        self.newest_committed: int | None = None  # newest version committed in this run (durable-age bound)
        self.may_remove = may_remove  # whether this rank holds the lock of a root (lock.py)
        self.retention = retention  # the next stage (retention.RetentionStage), or None
        self.io = io  # writes the reports and the manifest (io_worker.py); None: on this thread
        self._cpu = CpuMeter()  # the engine's CPU between two readings, for the telemetry's flush line
        self._cpu_read_at: float | None = None  # when it was last read (None: not yet)
        self._cpu_bytes = 0  # bytes checkpointed since then
        self._lock = threading.Lock()  # guards the pending list (the training thread adds)
        self._pending: list[CheckpointJob] = []
        self._manifest_bytes: dict[str, int] = {}  # rank 0, this thread: the bytes a manifest just written lists
        self._stopping = False
        self._thread = EngineThread(self._run, "datastates-committer")
        self._thread.start()

    def track(self, job: CheckpointJob) -> None:
        with self._lock:
            self._pending.append(job)

    def poke(self) -> None:
        """A commit was requested: look again."""
        self.signal.notify()

    def stop(self, timeout: float) -> None:
        with self._lock:
            self._stopping = True
        self.signal.notify()
        self._thread.join(timeout)

    def _next_ready(self) -> CheckpointJob | None:
        """The oldest checkpoint whose commit was requested, once it is durable here or abandoned.

        Between looks it sleeps until told of a change; the wait is bounded all the same, and each
        look first checks for a failure (which notifies too).
        """
        while True:
            seen = self.signal.seen()
            with self._lock:
                requested = [j for j in self._pending if j.commit_requested]
                if requested:
                    job = min(requested, key=lambda j: j.commit_seq)
                    if job.abandoned or job.durable_on(LEVEL_SHARED):
                        self._pending.remove(job)
                        return job
                if self._stopping and not requested:
                    return None
                try:
                    self.check()
                except CheckpointError:  # the engine stopped: nothing pending will become durable
                    for job in self._pending:
                        job.settle()
                    self._pending.clear()
                    return None
            self.signal.wait(seen, self.timeout_s)

    def _run(self) -> None:
        while True:
            job = self._next_ready()
            if job is None:
                return
            try:
                with self.telemetry.batch():  # the commit's records in one write, before waiters wake
                    self._commit(job)
                job.settle()
            except CheckpointSkipped as exc:
                if self.peer_skipped is not None:
                    self.peer_skipped(job, exc.report)
                job.settle()
            except BaseException as exc:
                if self.rank == 0:  # the others wait for a decision: make sure there is one
                    try:
                        self.channel.settle(job_key(job), CommitDecision.failed(
                            f"checkpoint {job.checkpoint} failed on rank 0: {type(exc).__name__}: {exc}").wire())
                    except Exception:
                        pass  # the store itself failed: the others time out, naming rank 0
                fatal = self.fail(exc, job)
                job.settle()  # waiters wake up and see the error
                if fatal:
                    return

    def _commit(self, job: CheckpointJob) -> None:
        """Report, post, decide (rank 0) or learn the decision; the caller then settles the job."""
        key = job_key(job)
        abandoned = not job.advance(JobState.REPORTED)  # skipped or failed before it could be reported: say so
        post = job.claim_status()
        if abandoned:
            if post:
                self.channel.post(key, abandoned_status(job))
            started = time.monotonic()  # rank 0's wait for every rank counts from here, its group's included
            self._forward(job, key)
            if self.rank == 0:
                self._decide(job, key, started)
            return
        try:
            job.commit_stage.hold(self.timeout_s, lambda: "this rank's report to be written")
            status, shares = self._write_reports(job)
        except BaseException as exc:
            if post:  # the others learn it now, not when rank 0's wait runs out
                self.channel.post(key, RankStatus.failed(f"{type(exc).__name__}: {exc}").wire())
            self._forward(job, key)
            raise
        self._emit_levels(job)
        faults.stop_point("after_report")
        if post:
            self.channel.post_durable(key, status, shares)
        started = time.monotonic()
        self._forward(job, key)
        if self.rank == 0:
            decision = self._decide(job, key, started)
        else:
            decision = self._await_decision(job, key)
        committed_bytes = self._manifest_bytes.pop(key, 0)  # rank 0 wrote the manifest: what it lists
        if decision.state == SKIPPED:
            raise CheckpointSkipped(decision.message, decision.report)
        if decision.state != COMMITTED:
            raise CheckpointError(decision.error or f"checkpoint {job.checkpoint} was not committed")
        manifest = CommittedManifest(decision.manifest, os.path.join(job.root, job.checkpoint))
        outcome = CommitOutcome(manifest, time.monotonic(), committed_bytes)
        job.publish_outcome(outcome)
        job.advance(JobState.COMMITTED)  # from here on a late skip notice is refused
        faults.stop_point("before_tracker")
        if manifest.version is not None and (self.newest_committed is None or manifest.version > self.newest_committed):
            self.newest_committed = manifest.version
        request = job.request
        for callback in request.on_committed:
            callback(manifest)
        if self.retention is not None and request.retain:
            self.retention.committed(job, manifest)
        first = min(f.submitted_at for f in job.files) if job.files else outcome.committed_at
        if self.rank == 0:
            self.telemetry.emit("commit", job.checkpoint, "all", outcome.committed_bytes,
                                outcome.committed_at - first, world_size=self.world_size, run=self.run_id)

    def _write_reports(self, job: CheckpointJob) -> tuple[list, dict[str, bytes]]:
        """This rank's report, durable on the shared level (and the local one); returns its durable status."""
        data, status = checked_report(job, self.rank, self.world_size)
        reports_dir = os.path.join(job.root, job.checkpoint, REPORTS)
        job.make_directory(reports_dir)
        self._atomic_write(os.path.join(reports_dir, report_name(self.rank, job.tag)), data)
        local = self.local_root(job)
        if local is not None:
            local_reports = os.path.join(local, job.checkpoint, REPORTS)
            job.make_directory(local_reports)
            self._atomic_write(os.path.join(local_reports, report_name(self.rank, job.tag)), data)
        return status

    def _atomic_write(self, path: str, data: bytes) -> None:
        """Temp file, fsync, rename, directory fsync (one PUT on the object-store level): one request to the worker."""
        if self.io is None:
            write_whole(path, data)
        else:
            self.io.atomic_write(path, data)

    def _emit_levels(self, job: CheckpointJob) -> None:
        if not job.files:
            return
        first = min(f.submitted_at for f in job.files)
        snap = max(f.snapshot_at or first for f in job.files)
        # When training was blocked for it, as [seconds after the first save call, seconds blocked].
        blocked = job.blocked  # the training thread's, read once: one whole value
        spans = [[round(start - first, 6), round(took, 6)] for start, took in blocked.spans]
        self.telemetry.emit("snapshot", job.checkpoint, LEVEL_HOST, job.nbytes, snap - first,
                            blocked_s=blocked.total_s, blocked_spans=spans, run=self.run_id)
        levels = [level for level in (LEVEL_LOCAL, LEVEL_SHARED)
                  if all(level in f.durable_at for f in job.files)]
        self._cpu_bytes += job.nbytes
        for level in levels:
            cpu = self._read_cpu() if level == levels[-1] else {}
            self.telemetry.emit("flush", job.checkpoint, level, job.nbytes,
                                max(f.durable_at[level] for f in job.files) - first,
                                blocked_s=blocked.total_s, run=self.run_id, **cpu)

    #: The engine's CPU is read at the first checkpoint, then at most this often: a reading costs this
    #: thread about 0.4 ms (a /proc read per engine thread), too much for every checkpoint of a run
    #: that saves every iteration.
    CPU_READ_INTERVAL_S = 10.0

    def _read_cpu(self) -> dict:
        """``cpu_s`` (the engine's CPU since the last reading: its threads and its I/O worker),
        ``cpu_bytes`` (checkpointed since then) and ``cpu_s_per_gb``, when a reading is due; else {}."""
        now = time.monotonic()
        if not CpuMeter.available() or (self._cpu_read_at is not None
                                        and now - self._cpu_read_at < self.CPU_READ_INTERVAL_S):
            return {}
        used = self._cpu.since_last(self.io.worker_pid if self.io is not None else None)
        nbytes, self._cpu_bytes, self._cpu_read_at = self._cpu_bytes, 0, now
        return {"cpu_s": used, "cpu_bytes": nbytes, "cpu_s_per_gb": used / (nbytes / 1e9) if nbytes else None}

    def _await_decision(self, job: CheckpointJob, key: str) -> CommitDecision:
        """Ranks other than 0: rank 0's decision on ``job``, the one verdict every rank reports.

        If the wait runs out while rank 0 has posted its own status, rank 0 is alive and collecting
        on a clock that started when its files became durable, later than this rank's: wait once
        more, so its verdict (naming the missing ranks) still comes from rank 0.
        """
        wait_s = self.timeout_s + DECISION_GRACE_S
        for attempt in (1, 2):
            job.commit_stage.hold(wait_s, lambda: "rank 0's decision (rank 0 waits for every rank's report)")
            try:
                return CommitDecision.from_wire(self.channel.await_decision(key, wait_s))
            except DecisionTimeout:
                rank0_posted = self.channel.posted(key, 0)
                if not rank0_posted:
                    raise CheckpointError(f"checkpoint {job.checkpoint}: rank 0 did not report or decide within "
                                          f"{wait_s * attempt:.0f}s (rank 0 is gone or stuck)") from None
                if attempt == 2:
                    raise CheckpointError(f"checkpoint {job.checkpoint}: rank 0 reported but did not decide within "
                                          f"{wait_s * attempt:.0f}s (rank 0 is stuck)") from None
        raise AssertionError("unreachable")

    def _forward(self, job: CheckpointJob, key: str) -> None:
        """A group's leader (``CommitGroups``): its group's statuses to rank 0, once per checkpoint
        (the failure handler forwards at once for a leader whose engine failed)."""
        if not self.channel.leads or not job.claim_forward():
            return
        group = self.channel.groups.group_of(self.rank)
        ranks = self.channel.groups.ranks(group)
        job.commit_stage.hold(self.timeout_s, lambda: f"the reports of ranks {ranks.start}-{ranks.stop - 1}, "
                                                      "its group" + self._missing(key, group))
        self.channel.forward(key, self.timeout_s, MANIFEST_SHARES, functools.partial(summarize_heads, job.checkpoint))

    def _decide(self, job: CheckpointJob, key: str, started: float) -> CommitDecision:
        """Rank 0: every rank's status, then the manifest (if all are durable), then the decision.

        Returns the decision that stands (one published earlier, by a failure, wins). This wait is
        the deadline of the commit (from ``started``, before rank 0 forwarded its own group): the
        training thread's own wait defers to it (deadlines.py).
        """
        timeout_s = max(self.timeout_s - (time.monotonic() - started), 1.0)
        job.commit_stage.hold(timeout_s, lambda: "every rank's report of its files" + self._missing(key))
        collected = self.channel.collect(key, timeout_s)
        with gc_paused():
            return self._settle(job, key, collected)

    def _settle(self, job: CheckpointJob, key: str, collected: Collected) -> CommitDecision:
        others = [RankStatus.from_wire(s) for s in collected.others]
        skipped = [s for s in others if s.state == SKIPPED]
        failed = [s for s in others if s.state != SKIPPED]
        missing = collected.missing
        if skipped:
            first = skipped[0]
            decision = CommitDecision.skipped(
                first.skip_report(), f"checkpoint {job.checkpoint} skipped by rank {first.rank}: {first.reason}")
        elif failed:
            decision = CommitDecision.failed(f"checkpoint {job.checkpoint} failed on rank {failed[0].rank}: "
                                             f"{failed[0].error}")
        elif missing:
            decision = CommitDecision.failed(f"checkpoint {job.checkpoint}: not every rank reported its files "
                                             f"durable within {self.timeout_s:.0f}s (missing ranks: "
                                             + ", ".join(map(str, missing)) + ")")
        elif collected.unforwarded:
            leaders = ", ".join(map(str, collected.unforwarded))
            decision = CommitDecision.failed(f"checkpoint {job.checkpoint}: every rank reported its files durable, "
                                             f"but the group leader(s) {leaders} did not forward their groups' "
                                             f"reports within {self.timeout_s:.0f}s (gone or stuck, or a rank of "
                                             "the group reported late)")
        elif job.abandoned:  # rank 0 alone dropped it (its own failure decided already, or a race with it)
            decision = CommitDecision.failed(f"checkpoint {job.checkpoint} was abandoned on rank 0")
        else:
            job.commit_stage.hold(self.timeout_s, lambda: "rank 0 to write the manifest")
            try:
                header = self._write_manifest(job, key, collected)
            except CheckpointError as exc:
                decision = CommitDecision.failed(str(exc))
            else:
                decision = CommitDecision.committed(header)
        return CommitDecision.from_wire(self.channel.settle(key, decision.wire()))

    def _missing(self, key: str, group: int | None = None) -> str:
        try:
            missing = self.channel.missing(key, group)
        except Exception:  # only a message: never fail on it
            return ""
        return " (missing ranks: " + ", ".join(map(str, missing)) + ")" if missing else ""

    def _write_manifest(self, job: CheckpointJob, key: str, collected: Collected) -> dict:
        """The manifest from every rank's durable status and shares, written atomically; returns its header.

        Each share passed its rank's ``check_share``; here rank 0 checks that each arrived as
        posted and what spans ranks, and the manifest then passes ``read_manifest`` (docs/FORMAT.md).
        """
        ckpt_dir = os.path.join(job.root, job.checkpoint)
        path = os.path.join(ckpt_dir, MANIFEST)
        try:
            heads, shares = self.channel.open_shares(collected, MANIFEST_SHARES)
        except ShareDamaged as exc:
            raise CheckpointError(f"checkpoint {job.checkpoint}: {exc}; the checkpoint is not committed "
                                  f"({path} not written)") from None
        groups = self.channel.groups
        if groups.flat:
            summary = summarize_heads(job.checkpoint, heads, range(self.world_size))
        else:  # each group's leader condensed its group's heads (``_forward``)
            summary = merge_summaries(job.checkpoint, heads, groups.count)
        attempt_of = self.run_id if job.tag != self.run_id else None  # a second save of this id in this run
        header, data = assemble_manifest(job.checkpoint, job.tag, job.version, self.world_size, summary, shares,
                                         attempt_of)
        may_remove = self.may_remove(job.root)
        # A new directory holds no other run's files. An object store has no directories: there a
        # manifest found before this one's write (one HEAD) says the id was committed before.
        replaced = may_remove and is_object_url(ckpt_dir) and manifest_exists(ckpt_dir)
        self._atomic_write(path, data)
        self._manifest_bytes[key] = summary[0]  # for the outcome (``_commit``)
        if may_remove and (replaced if is_object_url(ckpt_dir) else not job.created(ckpt_dir)):
            remove_unlisted(ckpt_dir, job.tag)
        return header
