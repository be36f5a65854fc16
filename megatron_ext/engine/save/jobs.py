"""The bookkeeping records shared by the engine's threads: one per file, one per checkpoint."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..format.names import LEVEL_SHARED
from ..format.safetensors import FileLayout

_POLL_S = 0.05  # how often a wait re-checks for background failures


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
    flush_started: bool = False  # the writer took its first chunk; from then on it cannot be superseded
    # Temporaries that must outlive their asynchronous copies (CUDA .contiguous() results).
    keepalive: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.layout.size

    @property
    def root(self) -> str:
        """Its checkpoint's shared root directory."""
        return self.job.root

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
    commit_requested: bool = False
    on_committed: list[Callable[[dict], None]] = dataclasses.field(default_factory=list)
    committed: threading.Event = dataclasses.field(default_factory=threading.Event)
    manifest: dict | None = None
    blocked_s: float = 0.0  # time the training thread spent inside save/wait_snapshot for it
    #: When it was blocked: (monotonic start, seconds) of each save/wait_snapshot call counted in ``blocked_s``.
    blocked_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    error: BaseException | None = None  # set when abandoned under on_failure="continue"
    committed_at: float | None = None
    #: Whether retention runs after this commit, and its own ``keep_last`` (None: the config's).
    retain: bool = False
    keep_last: int | None = None
    committed_bytes: int = 0  # rank 0: bytes of every rank's files in the manifest (for telemetry)
    #: "wait" or "supersede": what this checkpoint's snapshot does when the host cache is full.
    policy: str = "wait"
    #: Set when skipped under overload: {"reason", "superseded_by", "by_rank"}; never committed then.
    skipped: dict | None = None
    reported: bool = False  # this rank's report is written: a skip decided here is no longer allowed
    status_posted: bool = False  # this rank told the others (commit store) what became of it
    commit_seq: int = -1  # the order commits were requested in, the same on every rank
    discard_sent: bool = False  # the writer was told to remove this rank's files of it
    #: While the commit waits on other ranks: says for what (a timeout names it, whichever side times out first).
    commit_waiting_for: Callable[[], str] | None = None

    @property
    def abandoned(self) -> bool:
        """Failed (``on_failure="continue"``) or skipped: it will not be committed."""
        return self.error is not None or self.skipped is not None

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes + len(f.sidecar) for f in self.files)

    def durable_on(self, level: str) -> bool:
        return all(level in f.durable_at for f in self.files)

    def wait_settled(self, deadline: float, check: Callable[[], None]) -> None:
        """Block until committed (once its commit was requested), else until durable on the shared
        level or abandoned. ``check`` raises a background failure; every poll runs it, so a failure
        ends the wait at once instead of at the deadline."""
        if self.commit_requested:
            while not self.committed.wait(_POLL_S):
                check()
                if time.monotonic() > deadline:
                    waiting_for = self.commit_waiting_for
                    reason = f": {waiting_for()}" if waiting_for is not None else ""
                    raise CheckpointError(f"commit of {self.checkpoint} did not finish in time (timeout){reason}")
        else:
            while not self.durable_on(LEVEL_SHARED) and not self.abandoned:
                check()
                if time.monotonic() > deadline:
                    raise CheckpointError(f"flush of {self.checkpoint} did not finish in time")
                time.sleep(_POLL_S)
        check()
