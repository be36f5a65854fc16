"""The bookkeeping records shared by the engine's threads: one per file, one per checkpoint.

A checkpoint's progress on this rank is one ``JobState``, moved only by ``CheckpointJob.advance``
(and ``skip`` / ``fail``, which record why) under the job's own lock: the moves that exclude each
other (the writer starts flushing, this rank reports, a skip, a failure) are decided there, so
no stage shares a lock with another.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import CheckpointError
from ..format.names import LEVEL_SHARED
from ..format.tensor_file import FileLayout
from .deadlines import StageDeadline

if TYPE_CHECKING:
    from .io_ops import FileChecksums

_POLL_S = 0.05  # how often a wait re-checks for background failures


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
    cuda_mark: Any  # the copier's stream point (CUDA) the copies follow; a gated save's is set when its gate opens
    tensor_rel: str  # paths relative to the level's root directory
    sidecar_rel: str
    extra: dict | None = None  # caller's JSON-able index, copied into the report and manifest
    gate: Any = None  # a CopyGate (copy_gate.py): copies start once it opens; None: at once
    submitted_at: float = dataclasses.field(default_factory=time.monotonic)
    snapshot_at: float | None = None
    durable_at: dict[str, float] = dataclasses.field(default_factory=dict)
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

    def take_checksums(self, sums: "FileChecksums") -> None:
        """The checksums ``io_ops.FileIo.finish`` returned for this file (hex): file, tensors in file order, sidecar."""
        self.file_xxh3 = sums.file
        self.tensor_xxh3 = {s.name: digest for s, digest in zip(self.layout.spans, sums.tensors)}
        self.sidecar_xxh3 = sums.sidecar

    def num_chunks(self, chunk_bytes: int) -> int:
        return -(-self.layout.size // chunk_bytes)

    def report(self) -> dict:
        """This file's entry in the rank report and the manifest."""
        entry = {
            "name": self.name,
            "tensor_file": self.tensor_rel,
            "state_file": self.sidecar_rel,
            "size": self.layout.size,
            "state_size": len(self.sidecar),
            "xxh3_64": self.file_xxh3,
            "state_xxh3_64": self.sidecar_xxh3,
            "tensors": {
                s.name: {"dtype": s.dtype, "shape": s.shape, "offsets": [s.start, s.end],
                         "xxh3_64": self.tensor_xxh3.get(s.name)}
                for s in self.layout.spans
            },
        }
        if self.extra is not None:
            entry["extra"] = self.extra
        return entry


@dataclasses.dataclass(eq=False)
class CheckpointJob:
    """Everything one rank saves under one checkpoint id, and its progress through the levels."""

    checkpoint: str
    root: str
    version: int | None
    #: Names this attempt's files, reports and manifest (12 hex digits): the run id, or for a
    #: checkpoint id saved again in the same run, one derived from it (``attempt_tag``).
    tag: str = ""
    files: list[FileJob] = dataclasses.field(default_factory=list)
    #: The caller asked to commit it (set once, by the training thread; ``commit_seq`` is its place in
    #: the commit order, the same on every rank). Not a state: a skipped checkpoint is still settled in order.
    commit_requested: bool = False
    commit_seq: int = -1
    on_committed: list[Callable[[dict], None]] = dataclasses.field(default_factory=list)
    #: Set once the committer is done with it (committed, skipped or failed): waiters wake up.
    settled: threading.Event = dataclasses.field(default_factory=threading.Event)
    manifest: dict | None = None
    blocked_s: float = 0.0  # time the training thread spent inside save/wait_snapshot for it
    #: When it was blocked: (monotonic start, seconds) of each save/wait_snapshot call counted in ``blocked_s``.
    blocked_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    error: BaseException | None = None  # why it failed (``fail``)
    committed_at: float | None = None
    #: Whether retention runs after this commit, and its own ``keep_last`` (None: the config's).
    retain: bool = False
    keep_last: int | None = None
    committed_bytes: int = 0  # rank 0: bytes of every rank's files in the manifest (for telemetry)
    #: "wait" or "supersede": what this checkpoint's snapshot does when the host cache is full.
    policy: str = "wait"
    #: Why it was skipped under overload: {"reason", "superseded_by", "by_rank", ...} (``skip``).
    skipped: dict | None = None
    #: The committer's bounded wait for this checkpoint (its report, the other ranks, rank 0's decision):
    #: a training-thread wait that runs out defers to it, so the committer's error names what is missing.
    commit_stage: StageDeadline = dataclasses.field(default_factory=StageDeadline, repr=False)
    #: The writer's or stager's request to the I/O worker for this checkpoint, bounded by the worker's
    #: reply timeout: on a near tie with a flush wait, the request's error is the one raised.
    flush_stage: StageDeadline = dataclasses.field(default_factory=StageDeadline, repr=False)
    state: JobState = dataclasses.field(default=JobState.OPEN, init=False)
    #: Directories of this checkpoint known to exist (``make_directory``), and those this run created.
    _directories: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _created: set[str] = dataclasses.field(default_factory=set, init=False, repr=False)
    _status_claimed: bool = dataclasses.field(default=False, init=False, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

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
        return True

    def begin_flush(self) -> bool:
        """The writer takes one of its chunks: from now on this rank cannot supersede it. False if abandoned."""
        with self._lock:
            if self.state is JobState.OPEN:
                self._move(JobState.FLUSHING)
            return self.state not in ABANDONED

    def skip(self, info: dict, *, allowed_from: frozenset[JobState]) -> bool:
        """Record a skip (``info``: why, by whom) unless the job moved past ``allowed_from`` or is settled."""
        with self._lock:
            if self.settled.is_set() or not self._move(JobState.SKIPPED, allowed_from):
                return False
            self.skipped = info
            return True

    def fail(self, exc: BaseException) -> None:
        """Record the first failure; a job not yet committed, skipped or failed is failed by it."""
        with self._lock:
            if self.error is None:
                self.error = exc
            self._move(JobState.FAILED)

    def claim_status(self) -> bool:
        """True once: the caller posts this rank's one status of the checkpoint to the commit store."""
        with self._lock:
            claimed, self._status_claimed = self._status_claimed, True
            return not claimed

    def make_directory(self, path: str) -> None:
        """``path`` exists once this returns: one ``mkdir`` per directory of the checkpoint, not one
        per file (each system call on a background thread is a GIL switch for the training thread)."""
        if path in self._directories:
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
        return path in self._created

    # ------------------------------------------------------------------ reading
    @property
    def abandoned(self) -> bool:
        """Failed or skipped: it will not be committed."""
        return self.state in ABANDONED

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes + len(f.sidecar) for f in self.files)

    def durable_on(self, level: str) -> bool:
        return all(level in f.durable_at for f in self.files)

    def wait_settled(self, deadline: float, check: Callable[[], None]) -> None:
        """Block until committed (once its commit was requested), else until durable on the shared
        level or abandoned. ``check`` raises a background failure; every poll runs it, so a failure
        ends the wait at once instead of at the deadline.

        Past ``deadline`` the wait goes on while the committer holds a deadline of its own for this
        checkpoint (deadlines.py): its verdict, which names the missing ranks, is the error raised.
        """
        if self.commit_requested:
            while not self.settled.wait(_POLL_S):
                check()
                if time.monotonic() > self.commit_stage.ends(deadline):
                    raise CheckpointError(f"commit of {self.checkpoint} did not finish in time (timeout): "
                                          f"{self._waiting_for()}")
        else:
            while not self.durable_on(LEVEL_SHARED) and not self.abandoned:
                check()
                if time.monotonic() > self.flush_stage.ends_on_tie(deadline):
                    stage = self.flush_stage.describe()
                    raise CheckpointError(f"flush of {self.checkpoint} did not finish in time"
                                          + (f": still waiting for {stage}" if stage else ""))
                time.sleep(_POLL_S)
        check()

    def _waiting_for(self) -> str:
        """What this rank's commit of it still waits for (for the timeout's message)."""
        stage = self.commit_stage.describe()
        if stage:
            return f"still waiting for {stage}"
        if not self.durable_on(LEVEL_SHARED):
            return "this rank's files are not durable on the shared level yet"
        return "the committer has not taken it up (an earlier checkpoint's commit is still pending)"
