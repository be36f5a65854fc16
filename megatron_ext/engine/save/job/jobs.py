"""The bookkeeping records shared by the engine's threads: one per file, one per checkpoint.

A checkpoint's progress on this rank is one ``JobState``, moved only by ``CheckpointJob.advance``
(and ``skip`` / ``fail``, which record why) under the job's own lock: the moves that exclude each
other (the writer starts flushing, this rank reports, a skip, a failure) are decided there, so
no stage shares a lock with another.

Every other field has one writer thread (docs/ARCHITECTURE.md, "Who writes what"): the training
thread's files, ``CommitRequest`` and ``BlockedTime``; the writer's and stager's durability of
each file (``mark_durable``); the committer's ``CommitOutcome``; the skip's ``SkipRecord``. Each
is published under the job's lock as one frozen value, and the job's condition is notified, so
waiters on other threads (``wait_settled``, the replicator, ``wait_snapshot``) are told instead
of polling, and read one whole value.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ...config import OverloadPolicy
from ...errors import CheckpointError
from ...format.names import LEVEL_SHARED
from ...object_store import is_object_url
from ...format.report import file_entry
from ...format.tensor_file import FileLayout
from .deadlines import StageDeadline
from .skip import SkipRecord

if TYPE_CHECKING:
    from ...format.digest import FileChecksums
    from ...read.entries import CommittedManifest

#: The longest a notified wait sleeps before it re-checks on its own: every change and every
#: background failure notifies, so this only bounds what a missed notification could cost.
RECHECK_S = 1.0


class JobState(enum.Enum):
    """Where one rank's part of a checkpoint stands."""

    OPEN = "open"  # saved files are being copied; nothing is written yet: a skip still drops it whole
    FLUSHING = "flushing"  # the writer took its first chunk: this rank may no longer supersede it
    REPORTED = "reported"  # this rank's report is being written: only a peer's skip or a failure stops it
    COMMITTED = "committed"  # rank 0 decided: the manifest is durable
    SKIPPED = "skipped"  # dropped under overload (by this rank or a peer): never committed
    DISCARDED = "discarded"  # skipped, and the writer was told to remove this rank's files of it
    FAILED = "failed"  # failed here (``on_failure="continue"``) or its commit failed


#: The moves ``advance`` allows; anything else is refused (another thread's move came first).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.OPEN: frozenset({JobState.FLUSHING, JobState.REPORTED, JobState.SKIPPED, JobState.FAILED}),
    JobState.FLUSHING: frozenset({JobState.REPORTED, JobState.SKIPPED, JobState.FAILED}),
    JobState.REPORTED: frozenset({JobState.COMMITTED, JobState.SKIPPED, JobState.FAILED}),
    JobState.SKIPPED: frozenset({JobState.DISCARDED}),
    JobState.COMMITTED: frozenset(),
    JobState.DISCARDED: frozenset(),
    JobState.FAILED: frozenset(),
}
ABANDONED = frozenset({JobState.SKIPPED, JobState.DISCARDED, JobState.FAILED})


@dataclasses.dataclass(eq=False)
class FileJob:
    """One ``save`` call: one safetensors file plus its sidecar, for one rank."""

    job: "CheckpointJob"  # the checkpoint this file belongs to
    name: str
    layout: FileLayout
    sidecar: bytes
    cuda_mark: Any  # the copier's stream point (CUDA) the copies follow; a gated save's: ``gate_opened``
    tensor_rel: str  # paths relative to the level's root directory
    sidecar_rel: str
    extra: dict | None = None  # caller's JSON-able index, copied into the report and manifest
    gate: Any = None  # a CopyGate (copy_gate.py): copies start once it opens; None: at once
    submitted_at: float = dataclasses.field(default_factory=time.monotonic)
    snapshot_at: float | None = None  # when its copy finished: ``snapshot_finished``
    #: Level -> when it became durable there: written only through ``CheckpointJob.mark_durable``
    #: (the writer its first level, the stager the shared one), read under the job's lock.
    durable_at: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Written once, by ``take_checksums`` under the job's lock, before the file counts as durable.
    file_xxh3: str | None = None
    sidecar_xxh3: str | None = None
    tensor_xxh3: dict[str, str] = dataclasses.field(default_factory=dict)
    snapshot_done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def nbytes(self) -> int:
        return self.layout.size

    @property
    def root(self) -> str:
        """Its checkpoint's shared root directory."""
        return self.job.root

    def gate_opened(self, mark: Any) -> None:
        """A gated file's copies follow ``mark`` (taken on the thread that opened the gate)."""
        with self.job.locked():
            self.cuda_mark = mark

    def snapshot_finished(self, copied: bool = False) -> None:
        """The snapshot thread is done with this file (``copied``, or given up): ``wait_snapshot`` is told."""
        if copied:
            with self.job.locked():
                self.snapshot_at = time.monotonic()
        self.snapshot_done.set()
        self.job.wake()

    def take_checksums(self, sums: "FileChecksums") -> None:
        """The checksums ``io_ops.FileIo.finish`` returned for this file (hex): file, tensors in file order, sidecar."""
        tensors = {s.name: digest for s, digest in zip(self.layout.spans, sums.tensors)}
        with self.job.locked():
            self.file_xxh3, self.tensor_xxh3, self.sidecar_xxh3 = sums.file, tensors, sums.sidecar

    def num_chunks(self, chunk_bytes: int) -> int:
        return -(-self.layout.size // chunk_bytes)

    def report(self) -> dict:
        """This file's entry in the rank report and the manifest (``format.report.file_entry``)."""
        with self.job.locked():
            sums = self.file_xxh3, self.sidecar_xxh3, self.tensor_xxh3
        return file_entry(self.name, self.tensor_rel, self.sidecar_rel, self.layout, len(self.sidecar), *sums, self.extra)


@dataclasses.dataclass(frozen=True)
class CommitRequest:
    """The training thread's ``commit`` of a checkpoint: its place in the commit order (the same
    on every rank), the callbacks to run once committed, and its retention."""

    seq: int
    on_committed: tuple[Callable[[Any], None], ...] = ()
    retain: bool = False  # whether retention runs after this commit
    keep_last: int | None = None  # its own ``keep_last`` (None: the config's)


@dataclasses.dataclass(frozen=True)
class BlockedTime:
    """The training thread's time inside save/wait_snapshot for one checkpoint: the total, and
    each call as (monotonic start, seconds)."""

    total_s: float = 0.0
    spans: tuple[tuple[float, float], ...] = ()

    def plus(self, started: float, took: float) -> "BlockedTime":
        return BlockedTime(self.total_s + took, self.spans + ((started, took),))


@dataclasses.dataclass(frozen=True)
class CommitOutcome:
    """The committer's record of a committed checkpoint."""

    manifest: "CommittedManifest"
    committed_at: float  # monotonic
    committed_bytes: int  # rank 0: bytes of every rank's files in the manifest (for telemetry); else 0


@dataclasses.dataclass(eq=False)
class CheckpointJob:
    """Everything one rank saves under one checkpoint id, and its progress through the levels."""

    checkpoint: str
    root: str
    version: int | None
    #: Names this attempt's files, reports and manifest (12 hex digits): the run id, or for a
    #: checkpoint id saved again in the same run, one derived from it (``attempt_tag``).
    tag: str = ""
    #: What this checkpoint's snapshot does when the host cache is full (fixed when it is made).
    policy: OverloadPolicy = OverloadPolicy.WAIT
    #: The training thread's files (``add_file``); read by the others once its commit is requested.
    files: list[FileJob] = dataclasses.field(default_factory=list)
    #: Set once the committer is done with it (committed, skipped or failed): waiters wake up (``settle``).
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: The committer's bounded wait for this checkpoint (its report, the other ranks, rank 0's decision):
    #: a training-thread wait that runs out defers to it, so the committer's error names what is missing.
    commit_stage: StageDeadline = dataclasses.field(default_factory=StageDeadline, repr=False)
    #: The writer's or stager's request to the I/O worker for this checkpoint, bounded by the worker's
    #: reply timeout: on a near tie with a flush wait, the request's error is the one raised.
    flush_stage: StageDeadline = dataclasses.field(default_factory=StageDeadline, repr=False)
    state: JobState = dataclasses.field(default=JobState.OPEN, init=False)
    #: One frozen record per writer thread (see the module docstring), replaced whole under the lock.
    request: CommitRequest | None = dataclasses.field(default=None, init=False)  # the training thread's
    blocked: BlockedTime = dataclasses.field(default_factory=BlockedTime, init=False)  # the training thread's
    outcome: CommitOutcome | None = dataclasses.field(default=None, init=False)  # the committer's
    skipped: SkipRecord | None = dataclasses.field(default=None, init=False)  # the skipping thread's (``skip``)
    error: BaseException | None = dataclasses.field(default=None, init=False)  # the first failure (``fail``)
    #: Directories of this checkpoint known to exist (``make_directory``), and those this run created.
    _directories: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _created: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _status_claimed: bool = dataclasses.field(default=False, init=False, repr=False)
    _forward_claimed: bool = dataclasses.field(default=False, init=False, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)
    #: Notified on every change a waiter may wait for; ``_changes`` counts them (``changes``/``wait_change``).
    _changed: threading.Condition = dataclasses.field(init=False, repr=False)
    _changes: int = dataclasses.field(default=0, init=False, repr=False)
    _directory_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.policy = OverloadPolicy(self.policy)
        self._changed = threading.Condition(self._lock)

    def locked(self) -> threading.Lock:
        """The job's lock, which also guards its files' fields written after ``save`` (``FileJob``)."""
        return self._lock

    # ------------------------------------------------------------------ being told of changes
    def _notify(self) -> None:
        """Under the lock: something a waiter may wait for changed."""
        self._changes += 1
        self._changed.notify_all()

    def wake(self) -> None:
        """Wake this job's waiters to look again (a file's snapshot finished, a failure, a starved copy)."""
        with self._lock:
            self._notify()

    def changes(self) -> int:
        """The change count now: take it before looking, so a change made meanwhile is not missed."""
        with self._lock:
            return self._changes

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Block until a change after ``seen``, at most ``timeout`` (capped at ``RECHECK_S``) seconds."""
        with self._lock:
            return self._changed.wait_for(lambda: self._changes != seen, max(0.0, min(timeout, RECHECK_S)))

    # ------------------------------------------------------------------ the training thread's records
    def add_file(self, fjob: FileJob) -> None:
        with self._lock:
            self.files.append(fjob)

    def add_blocked(self, started: float, took: float) -> None:
        with self._lock:
            self.blocked = self.blocked.plus(started, took)

    def request_commit(self, next_seq: Callable[[], int], on_committed: Callable[[Any], None] | None = None,
                       keep_last: int | None = None, retain: bool = False) -> bool:
        """The caller asked to commit it (again: more callbacks, a new retention); True the first time,
        when it takes its place in the commit order (``next_seq()``)."""
        with self._lock:
            old = self.request
            callbacks = (old.on_committed if old else ()) + ((on_committed,) if on_committed is not None else ())
            if retain:
                kept = (True, keep_last)
            else:
                kept = (old.retain, old.keep_last) if old else (False, None)
            self.request = CommitRequest(old.seq if old else next_seq(), callbacks, *kept)
            self._notify()
            return old is None

    def on_commit(self, callback: Callable[[Any], None]) -> None:
        """One more callback for a checkpoint whose commit was requested (the training thread's)."""
        with self._lock:
            old = self.request
            self.request = dataclasses.replace(old, on_committed=old.on_committed + (callback,))

    @property
    def commit_requested(self) -> bool:
        return self.request is not None

    @property
    def commit_seq(self) -> int:
        request = self.request
        return -1 if request is None else request.seq

    @property
    def blocked_s(self) -> float:
        return self.blocked.total_s

    @property
    def blocked_spans(self) -> tuple[tuple[float, float], ...]:
        return self.blocked.spans

    # ------------------------------------------------------------------ the writer's and stager's record
    def mark_durable(self, fjob: FileJob, level: str) -> None:
        """``fjob`` (of this job) is durable on ``level`` now (its checksums taken before)."""
        with self._lock:
            fjob.durable_at[level] = time.monotonic()
            self._notify()

    def durable_on(self, level: str) -> bool:
        with self._lock:
            return all(level in f.durable_at for f in self.files)

    # ------------------------------------------------------------------ the committer's record
    def publish_outcome(self, outcome: CommitOutcome) -> None:
        with self._lock:
            self.outcome = outcome
            self._notify()

    def settle(self) -> None:
        """The committer is done with it (or the engine stopped): waiters wake up."""
        self.settled.set()
        self.wake()

    @property
    def manifest(self) -> "CommittedManifest | None":
        outcome = self.outcome
        return None if outcome is None else outcome.manifest

    @property
    def committed_at(self) -> float | None:
        outcome = self.outcome
        return None if outcome is None else outcome.committed_at

    @property
    def committed_bytes(self) -> int:
        outcome = self.outcome
        return 0 if outcome is None else outcome.committed_bytes

    # ------------------------------------------------------------------ moves (each under the job's lock)
    def advance(self, to: JobState, *, allowed_from: frozenset[JobState] | None = None) -> bool:
        """Move to ``to`` if ``TRANSITIONS`` (and ``allowed_from``, when given) allow it from here.

        False: not allowed from the current state, i.e. another thread's move came first (the
        report beat a skip, a failure beat the report); the caller then leaves the job alone.
        """
        with self._lock:
            return self._move(to, allowed_from)

    def _move(self, to: JobState, allowed_from: frozenset[JobState] | None = None) -> bool:
        if to not in TRANSITIONS[self.state] or (allowed_from is not None and self.state not in allowed_from):
            return False
        self.state = to
        self._notify()
        return True

    def begin_flush(self) -> bool:
        """The writer takes one of its chunks: from now on this rank cannot supersede it. False if abandoned."""
        with self._lock:
            if self.state is JobState.OPEN:
                self._move(JobState.FLUSHING)
            return self.state not in ABANDONED

    def skip(self, record: SkipRecord, *, allowed_from: frozenset[JobState]) -> bool:
        """Record a skip (why, by whom) unless the job moved past ``allowed_from`` or is settled."""
        with self._lock:
            if self.settled.is_set() or not self._move(JobState.SKIPPED, allowed_from):
                return False
            self.skipped = record
            return True

    def fail(self, exc: BaseException) -> None:
        """Record the first failure; a job not yet committed, skipped or failed is failed by it."""
        with self._lock:
            if self.error is None:
                self.error = exc
            self._move(JobState.FAILED)
            self._notify()

    def claim_status(self) -> bool:
        """True once: the caller posts this rank's one status of the checkpoint to the commit store."""
        with self._lock:
            claimed, self._status_claimed = self._status_claimed, True
            return not claimed

    def claim_forward(self) -> bool:
        """True once: the caller, this rank being a group's leader, forwards the group's statuses."""
        with self._lock:
            claimed, self._forward_claimed = self._forward_claimed, True
            return not claimed

    def make_directory(self, path: str) -> None:
        """``path`` exists once this returns: one ``mkdir`` per directory of the checkpoint, not one
        per file (each system call on a background thread is a GIL switch for the training thread).
        The writer, the stager and the committer all call it: the sets are under a lock of their own,
        held across the ``mkdir`` so that ``created`` names the one thread that made it."""
        with self._directory_lock:
            if path in self._directories:
                return
            if is_object_url(path):  # an object store has no directories: a key's prefix is enough
                self._directories.add(path)
                return
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            except FileNotFoundError:  # the root itself is missing (removed meanwhile): make the chain
                os.makedirs(path, exist_ok=True)
            else:
                self._created.add(path)
            self._directories.add(path)

    def created(self, path: str) -> bool:
        """Whether this run created ``path`` (``make_directory``): then no earlier run left files there."""
        with self._directory_lock:
            return path in self._created

    # ------------------------------------------------------------------ reading
    @property
    def abandoned(self) -> bool:
        """Failed or skipped: it will not be committed."""
        return self.state in ABANDONED

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes + len(f.sidecar) for f in self.files)

    def wait_settled(self, deadline: float, check: Callable[[], None]) -> None:
        """Block until committed (once its commit was requested), else until durable on the shared
        level or abandoned. ``check`` raises a background failure; the failure handler wakes every
        open job, so a failure ends the wait at once instead of at the deadline.

        Past ``deadline`` the wait goes on while the committer holds a deadline of its own for this
        checkpoint (deadlines.py): its verdict, which names the missing ranks, is the error raised.
        """
        while True:
            seen = self.changes()
            check()
            if self.commit_requested:
                if self.settled.is_set():
                    break
                ends = self.commit_stage.ends(deadline)
                if time.monotonic() > ends:
                    raise CheckpointError(f"commit of {self.checkpoint} did not finish in time (timeout): "
                                          f"{self._waiting_for()}")
            else:
                if self.durable_on(LEVEL_SHARED) or self.abandoned:
                    break
                ends = self.flush_stage.ends_on_tie(deadline)
                if time.monotonic() > ends:
                    stage = self.flush_stage.describe()
                    raise CheckpointError(f"flush of {self.checkpoint} did not finish in time"
                                          + (f": still waiting for {stage}" if stage else ""))
            self.wait_change(seen, ends - time.monotonic() + 0.001)
        check()

    def _waiting_for(self) -> str:
        """What this rank's commit of it still waits for (for the timeout's message)."""
        stage = self.commit_stage.describe()
        if stage:
            return f"still waiting for {stage}"
        if not self.durable_on(LEVEL_SHARED):
            return "this rank's files are not durable on the shared level yet"
        return "the committer has not taken it up (an earlier checkpoint's commit is still pending)"
