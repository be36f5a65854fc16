"""``SaveContext``: what every stage of the save pipeline needs from the engine, in one object.

The engine builds one per rank and hands it to each stage, so a stage's constructor names its
neighbour (the next stage) and nothing else it does not own; "which directory does this file go
to at level X" has one answer here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..format.names import LEVEL_LOCAL, LEVEL_SHARED
from ..telemetry import Telemetry
from .job.jobs import CheckpointJob, FileJob


@dataclasses.dataclass(frozen=True, eq=False)
class SaveContext:
    """Identity, failure handling, limits and directories shared by snapshot, writer, stager and committer."""

    rank: int
    world_size: int
    run_id: str
    #: A background failure: ``fail(exc, job=None)`` returns True if the engine must stop.
    fail: Callable[..., bool]
    #: Raises on any thread once the engine stopped (cheap; stages call it while they wait).
    check: Callable[[], None]
    timeout_s: float  # bound of every wait (cache slot, peers' reports, manifest)
    telemetry: Telemetry
    local_dir: str | None  # node-local level, or None: then the shared level is the first
    o_direct: Any  # config's o_direct: True, False or "auto"
    chunk_bytes: int
    #: The rank's CUDA device (``device.rank_device``), which threads touching CUDA bind to; None without CUDA.
    device: int | None = None

    @property
    def first_level(self) -> str:
        """The level the writer writes to: node-local when configured, else shared."""
        return LEVEL_LOCAL if self.local_dir else LEVEL_SHARED

    def directory(self, job: FileJob | CheckpointJob, level: str) -> str | None:
        """The root under which ``job``'s files live at ``level`` (None: no node-local level)."""
        return self.local_dir if level == LEVEL_LOCAL else job.root


__all__ = ["SaveContext"]
