"""In-memory replicas on peers (GEMINI style): a lost node is recovered from another node's RAM.

With ``peer_replica`` on, every rank sends its files of each checkpoint it commits (the bytes the
writer wrote, read back from the first level once durable, plus the sidecar) to its *holder*: the
rank with the same local index on the next node. The holder keeps them in shared memory
(``<replica_dir>/node-N/of-rank-RRRRR/``, by default under ``/dev/shm``: host RAM that outlives
the holder's process, so a restarted holder still has them), verified against the sender's
checksums, and keeps only the newest committed replica per source (plus newer, not yet committed
ones).

Transport (peer_link.py): one dedicated gloo process group, created collectively when the engine
starts, used only by the replication thread and by recovery, so background transfers never
interleave with training collectives on the default group. The holder's copies: replica_store.py.

Recovery (``recover``, a collective at load time): ranks whose node-local copy is gone ask their
holder; the holder sends its replica if it has the manifest's run and sizes, else says why not;
the asking rank verifies every byte against the manifest's checksums and otherwise reads from the
shared file system. Each rank logs which source it used.
"""


from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import shutil
import threading
import time

from ...config import check_writable_dir
from ...errors import CheckpointError, ConfigError
from ...files import private_dir
from ..context import SaveContext
from ..flow.worker import QueueWorker
from ..job.deadlines import StageDeadline
from ..job.jobs import RECHECK_S, CheckpointJob
from .peer_link import Bundle, BundleFile, BundleMeta, PeerLink, mismatch
from .replica_store import ReplicaStore, expected_files

log = logging.getLogger("megatron_ext.engine")


# ---------------------------------------------------------------------------- peer mapping
def resolve_ranks_per_node(configured: int | None, world_size: int) -> int:
    """Ranks per node: the configured value, else torchrun's LOCAL_WORLD_SIZE; at least two nodes."""
    rpn = configured
    if rpn is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None or not local.isdigit():
            raise ConfigError("peer_replica needs ranks_per_node (LOCAL_WORLD_SIZE is not set)")
        rpn = int(local)
    if rpn < 1 or world_size % rpn:
        raise ConfigError(f"ranks_per_node {rpn} does not divide the world size {world_size}")
    if world_size // rpn < 2:
        raise ConfigError(f"peer_replica needs at least two nodes, but the {world_size} rank(s) at {rpn} per "
                          "node are one node: there is no other node to hold the replicas")
    return rpn


def holder_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank keeping ``rank``'s replica: same local index, next node (wrapping)."""
    return (rank + ranks_per_node) % world_size


def source_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank whose replica ``rank`` keeps."""
    return (rank - ranks_per_node) % world_size


def default_replica_dir(save_dir: str | None) -> str:
    """Host memory named after the job's checkpoint directory, so a restarted job finds it again,
    under a directory of this user's (``/dev/shm/megatron_ext-<uid>``, created 0700): a name
    anyone may take first in ``/dev/shm`` is never used as it is."""
    key = hashlib.sha1(os.path.abspath(save_dir or ".").encode()).hexdigest()[:12]
    return os.path.join(os.path.realpath("/dev/shm"), f"megatron_ext-{os.geteuid()}", f"replicas-{key}")

# ---------------------------------------------------------------------------- replication thread
@dataclasses.dataclass
class _Prune:
    """Queued when a checkpoint commits: older replicas held may go now."""

    root: str


class PeerReplicator(QueueWorker):
    """For each committed-to-be checkpoint, in commit order: send ours to the holder, keep the source's."""

    def __init__(self, ctx: SaveContext, link: PeerLink, store: ReplicaStore, holder: int, source: int):
        self.ctx = ctx
        self.link, self.store, self.holder, self.source = link, store, holder, source
        self.first_level = ctx.first_level  # what is sent: the bytes the writer wrote there
        self.timeout_s, self.fail, self.check = ctx.timeout_s, ctx.fail, ctx.check
        self._cond = threading.Condition()
        self._pending: list[CheckpointJob | _Prune] = []
        self._dead = False
        #: The bounded wait this thread is in (durability here, the exchange with the peers): a
        #: training-thread wait defers to it, so the replicator's error says what is missing.
        self.stage = StageDeadline()
        self.start("datastates-replicator")

    def submit(self, item: CheckpointJob | _Prune) -> None:
        with self._cond:
            self._pending.append(item)
        super().submit(item)

    def pending(self) -> set[str]:
        with self._cond:
            return {item.checkpoint for item in self._pending if isinstance(item, CheckpointJob)}

    def wait_idle(self, deadline: float) -> None:
        """Until nothing is pending; past ``deadline`` only while this thread's own bounded wait lasts."""
        with self._cond:
            while self._pending:
                self.check()
                if time.monotonic() > self.stage.ends(deadline):
                    stage = self.stage.describe()
                    raise CheckpointError(f"replication to the peer did not finish in time "
                                          f"({len(self._pending)} item(s) pending"
                                          + (f"; still waiting for {stage})" if stage else ")"))
                self._cond.wait(max(0.0, min(RECHECK_S, self.stage.ends(deadline) - time.monotonic())) + 0.001)
        self.check()

    def handle(self, item: CheckpointJob | _Prune) -> None:
        try:
            if self._dead:
                pass
            elif isinstance(item, _Prune):
                self.store.prune(item.root)
            else:
                self._replicate(item)
        except BaseException as exc:
            self._dead = True
            what = "pruning the replicas" if isinstance(item, _Prune) else f"replication of {item.checkpoint}"
            self.fail(CheckpointError(f"{what} with the peers failed: {type(exc).__name__}: {exc}"))
        finally:
            self.stage.release()
            with self._cond:
                self._pending.remove(item)
                self._cond.notify_all()

    def _replicate(self, job: CheckpointJob) -> None:
        deadline = time.monotonic() + self.timeout_s
        self.stage.hold(self.timeout_s, lambda: f"{job.checkpoint} to become durable on the {self.first_level} level")
        while True:  # the writer's ``mark_durable`` and any failure wake this wait (jobs.py)
            seen = job.changes()
            if job.durable_on(self.first_level) or job.error is not None:
                break
            self.check()
            if time.monotonic() > deadline:
                raise CheckpointError(f"{job.checkpoint} did not become durable in time")
            job.wait_change(seen, deadline - time.monotonic() + 0.001)
        started = time.monotonic()
        outgoing = None
        if job.error is None:  # an abandoned checkpoint still takes part, sending nothing
            files = []
            for f in job.files:
                files.append(BundleFile(f.tensor_rel, f.layout.size, f.file_xxh3, tuple(f.layout.cuts())))
                files.append(BundleFile(f.sidecar_rel, len(f.sidecar), f.sidecar_xxh3))
            meta = BundleMeta(tuple(files), job.checkpoint, job.version, job.tag)
            outgoing = Bundle(meta, self.ctx.directory(job, self.first_level))
        self.stage.hold(self.timeout_s, lambda: f"the exchange of {job.checkpoint} with ranks {self.holder} "
                        f"(holder) and {self.source} (source)")
        meta, received = self.link.exchange(self.holder, outgoing, self.source, self.store.begin())
        if meta.checkpoint not in (None, job.checkpoint):
            raise CheckpointError(f"rank {self.source} sent {meta.checkpoint} while this rank replicates "
                                  f"{job.checkpoint}: ranks must commit checkpoints in the same order")
        if meta.files:
            problem = mismatch(meta.files, received)
            if problem:
                raise CheckpointError(f"the replica of rank {self.source}'s {job.checkpoint} is damaged: {problem}")
            self.store.keep(meta)
        self.store.prune(job.root)
        sent = sum(f.size for f in (outgoing.meta.files if outgoing else ()))
        self.ctx.telemetry.emit("replica", job.checkpoint, "peer", sent, time.monotonic() - started, holder=self.holder)


# ---------------------------------------------------------------------------- the engine's facade
class PeerReplicas:
    """Replication of this rank's checkpoints to its holder, and recovery from it at load time."""

    def __init__(self, ctx: SaveContext, ranks_per_node: int | None, replica_dir: str):
        """``replica_dir``: the host-memory directory the replicas live in (``default_replica_dir``)."""
        import torch.distributed as dist

        rank, world_size, timeout_s = ctx.rank, ctx.world_size, ctx.timeout_s
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
            raise ConfigError("peer_replica needs torch.distributed initialised with every rank of the job")
        self.rank, self.world_size, self.run_id = rank, world_size, ctx.run_id
        self.ranks_per_node = resolve_ranks_per_node(ranks_per_node, world_size)
        self.holder = holder_of(rank, world_size, self.ranks_per_node)
        self.source = source_of(rank, world_size, self.ranks_per_node)
        self.timeout_s = timeout_s
        self.node_dir = os.path.join(replica_dir, f"node-{rank // self.ranks_per_node:05d}")
        check_writable_dir(self.node_dir, "replica_dir", private=True)  # host memory only this user reads
        self.restored = os.path.join(self.node_dir, f"restored-rank-{rank:05d}")
        self._restored_key: tuple[str, str] | None = None  # (checkpoint, run id) last asked for
        self._restored_files: dict[str, str] = {}
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.link = PeerLink(self.group, ctx.chunk_bytes, timeout_s)
        self.store = ReplicaStore(self.node_dir, self.source)
        self.replicator = PeerReplicator(ctx, self.link, self.store, self.holder, self.source)

    def submit(self, job: CheckpointJob) -> None:
        """Replicate ``job`` once durable on the first level; prune older replicas once it commits."""
        self.replicator.submit(job)
        job.on_commit(lambda manifest: self.replicator.submit(_Prune(job.root)))

    def pending(self) -> set[str]:
        return self.replicator.pending()

    def wait(self, deadline: float) -> None:
        self.replicator.wait_idle(deadline)

    def recover(self, checkpoint: str, manifest: dict | None, local_complete: bool) -> dict[str, str]:
        """Collective: fetch this rank's files from its holder unless the node-local copy is whole.

        Returns file name -> directory holding the verified peer copy (empty: read from storage).
        Every rank calls it the same number of times; the outcome for a checkpoint is kept and reused.
        """
        import torch.distributed as dist

        self.wait(time.monotonic() + self.timeout_s)
        mine = expected_files(manifest, self.rank) if manifest is not None else []
        key = (checkpoint, manifest["run_id"]) if manifest is not None else None
        fetched = key is not None and key == self._restored_key
        need = bool(mine) and not local_complete and not fetched
        needs: list = [None] * self.world_size
        dist.all_gather_object(needs, need, group=self.group)
        send_to = self.source if needs[self.source] else None
        outgoing = self.store.offer(checkpoint, manifest, self.source) if send_to is not None else None
        if need:
            shutil.rmtree(self.restored, ignore_errors=True)
            private_dir(self.restored, "replica_dir", root=self.node_dir)
        started = time.monotonic()
        meta, received = self.link.exchange(send_to, outgoing, self.holder if need else None,
                                            self.restored if need else None)
        if fetched:
            return self._restored_files
        if not need:
            if mine and local_complete:
                log.warning("[datastates] rank %d reads its files of %s from its node-local level", self.rank,
                            checkpoint)
            return {}
        problem = meta.unusable or mismatch(mine, received)
        self._restored_key, self._restored_files = key, {}
        if problem:
            shutil.rmtree(self.restored, ignore_errors=True)
            log.warning("[datastates] rank %d: the replica held by rank %d is unusable (%s); recovering rank %d "
                        "from the shared file system", self.rank, self.holder, problem, self.rank)
            return {}
        nbytes = sum(f.size for f in mine)
        log.warning("[datastates] recovered rank %d from peer memory (rank %d): %s, %.1f MB in %.2fs",
                    self.rank, self.holder, checkpoint, nbytes / 1e6, time.monotonic() - started)
        self._restored_files = {e["name"]: self.restored for e in manifest["files"].values() if e["rank"] == self.rank}
        return self._restored_files

    def close(self, clean_end: bool) -> None:
        """Stop the thread; at a normal end of the job also free the host memory the replicas use."""
        self.replicator.stop(5)
        if clean_end:
            self.store.clear()
            shutil.rmtree(self.restored, ignore_errors=True)
            for directory in (self.node_dir, os.path.dirname(self.node_dir)):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass  # other ranks' replicas are still there


__all__ = ["PeerReplicas", "holder_of", "source_of", "resolve_ranks_per_node", "default_replica_dir"]
