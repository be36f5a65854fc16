"""What travels down the save pipeline between its threads (one module, so every stage reads the same).

``Chunk`` goes snapshot -> writer; ``SettleSkip`` from the training thread or the committer to the
snapshot thread; ``Discard`` follows a skipped checkpoint's last chunk through the
writer and the stager, so each level removes its files only after its own in-flight chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .jobs import CheckpointJob, FileJob


@dataclasses.dataclass(eq=False)
class Chunk:
    """Filled cache slots: bytes [offset, offset + nbytes) of ``file``'s tensor file, in ``count``
    neighbouring slots from ``slot`` on (a run: one checksum call and one write for all of them)."""

    file: FileJob
    index: int  # the file's chunk number of the first slot
    last: bool
    slot: int
    offset: int
    nbytes: int
    ready: Callable[[], None]  # blocks until the slot's bytes are really there (CUDA event)
    count: int = 1


@dataclasses.dataclass(eq=False)
class Discard:
    """Sent down the flush pipeline behind a skipped checkpoint's last chunk: remove its files, and
    write the skip ``report`` (path, record) of the rank that skipped it; the writer's thread does
    that I/O, never the snapshot thread (on a stalled object store a write can take seconds)."""

    job: CheckpointJob
    report: tuple[str, dict] | None = None


@dataclasses.dataclass(eq=False)
class SettleSkip:
    """Sent to the snapshot thread when another thread skipped ``job``: settle it there (overload.SkipSettler)."""

    job: CheckpointJob


__all__ = ["Chunk", "Discard", "SettleSkip"]
