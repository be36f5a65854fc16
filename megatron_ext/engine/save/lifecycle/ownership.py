"""Who owns which directory: the run id every rank agrees on, and the locks that make one job the writer.

At start-up rank 0 draws the run id and locks ``save_dir`` before any rank can write; the outcome
travels with the run id (one broadcast), so a job refused by another job's lock stops on every
rank at once, naming the holder. Each node locks its ``local_dir`` (one all-reduce tells every
rank whether a node was refused). Other roots are locked by rank 0 on first use.

Only a holder of a directory's lock removes anything there (lock.py); ``holds`` and
``retention_runs`` are what retention and the committer ask before deleting.
"""

from __future__ import annotations

import logging
import os
import uuid

from . import object_root
from . import lock as dir_lock
from . import retention
from ...collectives import all_reduce_int
from ...config import EngineConfig
from ...errors import CheckpointError
from ...object_store import is_object_url, resolve_root

log = logging.getLogger("megatron_ext.engine")


def _broadcast_from_zero(values: list) -> list:
    """Rank 0's ``values`` on every rank (one small collective at start-up)."""
    import torch.distributed as dist

    box = list(values)
    dist.broadcast_object_list(box, src=0)
    return box


def _any_rank_failed(failed: bool) -> bool:
    """Whether any rank failed (one all-reduce at start-up), so every rank stops together."""
    import torch.distributed as dist

    return bool(all_reduce_int(int(failed), dist.ReduceOp.MAX))


class DirectoryOwnership:
    """The run id and this rank's directory locks, for the engine's life (``release`` at the end)."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, read_only: bool):
        self.config, self.rank, self.world_size, self.read_only = config, rank, world_size, read_only
        self.locks: dict[str, dir_lock.DirectoryLock] = {}  # root -> lock, on rank 0
        self.local_lock: dir_lock.DirectoryLock | None = None
        self._runs_of_root: dict[str, set[str]] = {}  # root -> runs whose checkpoints retention may remove
        self.run_id: str | None = None
        self.freed_bytes = 0  # by the start-up clean-up of crashed saves (rank 0)

    def start(self, run_id: str | None) -> str:
        """Agree on the run id, lock ``save_dir`` (rank 0) and ``local_dir`` (each node), remove crashed partials."""
        collective = run_id is None and self.world_size > 1
        run_id = run_id or uuid.uuid4().hex[:12]
        problem: str | None = None
        save_dir = resolve_root(self.config.save_dir) if self.config.save_dir else None
        if self.rank == 0 and save_dir and not self.read_only:
            try:
                self.locks[save_dir] = lock = hold_root(save_dir, run_id, "save_dir")
                if self.config.remove_partial_on_start and lock.held:
                    removed, self.freed_bytes = retention.remove_partial(save_dir, set(lock.runs))
                    if removed:
                        log.warning("[datastates] removed %d uncommitted save(s) left by a crash or skipped, "
                                    "%d bytes freed: %s", len(removed), self.freed_bytes, ", ".join(sorted(removed)))
            except CheckpointError as exc:
                problem = str(exc)
        if collective:
            run_id, problem = _broadcast_from_zero([run_id, problem])
        if problem is not None:
            self.release()
            raise dir_lock.LockedError(problem if self.rank == 0 else f"rank 0 could not start: {problem}")
        if self.config.local_dir and not self.read_only:
            failure: CheckpointError | None = None
            try:
                local_dir = os.path.abspath(self.config.local_dir)
                self.local_lock = lock = dir_lock.acquire(local_dir, run_id, "local_dir", same_run_ok=True)
                if self.config.remove_partial_on_start and lock.held and save_dir:
                    # The node's one holder, before the all-reduce below lets any rank of the node write.
                    removed, freed = retention.remove_uncommitted_local(local_dir, save_dir, set(lock.runs))
                    if removed:
                        log.warning("[datastates] removed %d node-local copies of checkpoints not committed on "
                                    "the shared level (a crash), %d bytes freed: %s", len(removed), freed,
                                    ", ".join(sorted(removed)))
            except CheckpointError as exc:
                failure = exc
            if (_any_rank_failed(failure is not None) if collective else failure is not None):
                self.release()
                raise failure or dir_lock.LockedError("local_dir is locked by another job on another node")
        self.run_id = run_id
        return run_id

    def lock_root(self, root: str) -> None:
        """On rank 0, the job's lock on ``root`` (created if missing), taken at its first use."""
        if self.rank != 0 or root in self.locks:
            return
        if not is_object_url(root):
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(f"cannot create checkpoint directory {root}: {exc.strerror or exc}") from None
        self.locks[root] = hold_root(root, self.run_id, "checkpoint directory")

    def holds(self, root: str) -> bool:
        """Whether this rank may remove things under ``root``: it holds the lock of that directory."""
        lock = self.locks.get(resolve_root(root))
        return lock is not None and lock.held

    @property
    def holds_local(self) -> bool:
        """Whether this rank's job holds its node's ``local_dir`` lock (then it may remove there)."""
        return self.local_lock is not None and self.local_lock.job_holds

    def retention_runs(self, root: str) -> set[str]:
        """Runs whose checkpoints under ``root`` retention may remove: those that held its lock."""
        lock = self.locks.get(root)
        if lock is not None:
            return set(lock.runs) if lock.held else set()
        if root not in self._runs_of_root:  # other ranks: the lock file's record, read once
            runs = object_root.runs_of(root) if is_object_url(root) else dir_lock.runs_of(root)
            self._runs_of_root[root] = set(runs) | {self.run_id}
        return self._runs_of_root[root]

    def release(self) -> None:
        for lock in list(self.locks.values()) + ([self.local_lock] if self.local_lock else []):
            lock.release()


def hold_root(root: str, run_id: str, what: str):
    """The job's hold on a root: the directory's flock, or on the object-store level its run record."""
    if is_object_url(root):
        return object_root.acquire(root, run_id, what)
    return dir_lock.acquire(root, run_id, what)


__all__ = ["DirectoryOwnership", "hold_root"]
