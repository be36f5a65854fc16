"""``SavePipeline``: one rank's save stages, built once, in the order each needs the ones before it.

Control flows one way and nothing is wired after construction:

1. ``CommitSignal`` and the ``CommitChannel`` (the committer's inbox and the ranks' store) come
   first, so the failure handler, the flush stages and the skips report to them without knowing
   the committer.
2. ``FailureHandler`` (the channel tells the other ranks of a failure), then the ``SaveContext``
   every stage shares.
3. The I/O worker (io_worker.py, started as the first copy begins), then ``LevelStager`` (with a
   node-local level) and ``RankWriter``, whose durable files go on to the stager or straight to
   the signal; each stage talks to the worker on a channel of its own.
4. ``SkipSettler``, which removes skipped checkpoints' files through the writer, then the
   ``SnapshotScheduler`` that runs it (on its thread alone).
5. ``PeerReplicas`` (with ``peer_replica``; a collective), ``RetentionStage`` (which spares what is
   still saved or replicated), the ``Committer``, which hands each commit to retention and a
   peer's skip to the scheduler, and last the training thread's ``Skips``, which reads the
   committer's newest committed version and hands its own skips to the scheduler.
"""

from __future__ import annotations

import time

import dataclasses
from typing import Any

from ..config import EngineConfig
from ..host_cache import HostCache
from ..telemetry import Telemetry
from .commit.committer import Committer
from .commit.coordination import CommitChannel, CommitGroups, open_stores
from .commit.failure import FailureHandler
from .context import SaveContext
from .flow.copier import make_copier
from .flow.flush import LevelStager, RankWriter
from .flow.io_worker import IoWorker, LocalIo
from .flow.snapshot import SnapshotScheduler
from .job.signal import CommitSignal
from .job.table import JobTable
from .lifecycle.ownership import DirectoryOwnership
from .lifecycle.retention import RetentionStage
from .overload import PeerSkips, SkipSettler, Skips
from .replicas.replica import PeerReplicas, default_replica_dir


@dataclasses.dataclass(eq=False)
class SavePipeline:
    """The stages of one rank's save path (see the module docstring for their order)."""

    context: SaveContext
    channel: CommitChannel
    signal: CommitSignal
    failures: FailureHandler
    io: "IoWorker | LocalIo"
    stager: LevelStager | None
    writer: RankWriter
    scheduler: SnapshotScheduler
    replicas: PeerReplicas | None
    retention: RetentionStage
    committer: Committer
    skips: Skips

    @classmethod
    def build(cls, config: EngineConfig, *, rank: int, world_size: int, run_id: str, jobs: JobTable,
              ownership: DirectoryOwnership, telemetry: Telemetry, cache: HostCache, device: int | None,
              use_cuda: bool, commit_store: Any = None, read_only: bool = False) -> "SavePipeline":
        """Every stage of a rank's save path, its threads started. A ``read_only`` engine's
        channel is private: it commits nothing."""
        timeout_s = config.persist_timeout_s
        waiting, notices = open_stores(run_id, timeout_s, 1 if read_only else world_size, commit_store,
                                       private=read_only)
        groups = None if read_only else CommitGroups.of(world_size, config.commit_fan_in)  # None: flat
        channel = CommitChannel(waiting, notices, rank, world_size, groups)
        signal = CommitSignal()
        failures = FailureHandler(rank, run_id, config.on_failure, jobs, telemetry, channel, signal)
        ctx = SaveContext(rank=rank, world_size=world_size, run_id=run_id, fail=failures.fail, check=failures.check,
                          timeout_s=timeout_s, telemetry=telemetry, local_dir=config.local_dir,
                          o_direct=config.o_direct, chunk_bytes=cache.chunk_bytes, device=device)
        io = open_io(config.flush_process, cache, timeout_s)
        stager = LevelStager(ctx, signal, io.channel("stager")) if ctx.local_dir else None
        writer = RankWriter(ctx, cache, stager if stager is not None else signal, io.channel("writer"))
        settler = SkipSettler(ctx, jobs, writer, channel, signal)
        scheduler = SnapshotScheduler(ctx, cache, make_copier(use_cuda, device), writer, settler)
        replicas = None
        if config.peer_replica:  # creates a process group: collective, like the run id
            replica_dir = config.replica_dir or default_replica_dir(config.save_dir)
            replicas = PeerReplicas(ctx, config.ranks_per_node, replica_dir)
        retention = RetentionStage(config, ownership, jobs, replicas)
        peer_skips = PeerSkips(telemetry, scheduler, signal)
        committer = Committer(ctx, channel=channel, signal=signal, peer_skipped=peer_skips.abandon,
                              may_remove=ownership.holds, retention=retention, io=io.channel("committer"))
        skips = Skips(ctx, config, jobs, cache, scheduler, channel, signal, lambda: committer.newest_committed)
        return cls(ctx, channel, signal, failures, io, stager, writer, scheduler, replicas, retention,
                   committer, skips)

    def running(self) -> list[str]:
        """The stage threads still alive (after ``stop``: those that did not end in time)."""
        stages = [self.scheduler, self.writer, self.stager, self.committer, self.replicas, self.retention.deleter]
        return [t.name for t in (getattr(s, "_thread", None) for s in stages if s is not None)
                if t is not None and t.is_alive()]

    def stop(self, clean_end: bool, deadline: float | None = None) -> None:
        """Stop every thread, from the first stage to the last (``clean_end``: free the peer replicas held).

        One ``deadline`` (``time.monotonic()``) for all of them when given: a shutdown's wait and this
        stop then end within its timeout, also when a thread is stuck on storage (a wait ordered below
        a watchdog's, ``megatron.fault_tolerance``, stays below it). Without one: 5 s per stage and a
        minute for retention's deletes.
        """
        def left(default: float) -> float:
            return default if deadline is None else max(0.0, deadline - time.monotonic())

        if self.replicas is not None:
            self.replicas.close(clean_end)
        self.scheduler.stop(left(5))
        self.writer.stop(left(5))
        if self.stager is not None:
            self.stager.stop(left(5))
        self.committer.stop(left(5))
        self.io.close()
        self.retention.stop(left(60))


def open_io(use_worker: bool, cache: HostCache, timeout_s: float) -> "IoWorker | LocalIo":
    """The I/O worker process over the cache's shared memory (``use_worker``: ``flush_process``), or
    the same operations on the calling threads (``flush_process: false``, or no memfd on this system)."""
    if use_worker and cache.shared_fd is not None:
        return IoWorker(cache.shared_fd, cache.nbytes, timeout_s)
    return LocalIo(cache.shared_memory())


__all__ = ["SavePipeline"]
