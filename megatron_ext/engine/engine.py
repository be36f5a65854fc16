"""``CheckpointEngine``: the public face of the lazy asynchronous multi-level checkpoint engine.

Read top to bottom, a checkpoint goes: ``save`` (bookkeeping only, on the caller's thread) ->
``SnapshotScheduler`` (copies into the host cache in the background) -> ``RankWriter`` (streams
each chunk to the first storage level) -> ``LevelStager`` (node-local to shared, if configured)
-> ``Committer`` (rank reports, manifest = commit marker, callbacks). The training loop calls
``wait_snapshot`` right before it mutates the saved tensors, and nothing else.

The engine knows nothing of Megatron or DeepSpeed: nested states of tensors in, files out.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import traceback
import uuid
import weakref
from typing import Any, Callable, Mapping

import torch

from . import codec, layout as file_layout, restore, retention
from .commit import Committer, list_committed, read_manifest, report_name, REPORTS
from .config import ConfigError, EngineConfig, check_writable_dir
from .copier import make_copier
from .files import atomic_write_json
from .flush import LevelStager, RankWriter
from .host_cache import HostCache
from .jobs import CheckpointError, CheckpointJob, FileJob, LEVEL_LOCAL, LEVEL_PEER, LEVEL_SHARED
from .replica import PeerReplicas, default_replica_dir
from .snapshot import Chunk, SnapshotScheduler
from .telemetry import Telemetry

_POLL_S = 0.05
log = logging.getLogger("megatron_ext.engine")
_live_engines: "weakref.WeakSet[CheckpointEngine]" = weakref.WeakSet()


def _default_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree_run_id(world_size: int) -> str:
    """Every rank of a job must tag its files with the same run id: rank 0 picks, all receive."""
    run_id = uuid.uuid4().hex[:12]
    if world_size > 1:
        import torch.distributed as dist

        box = [run_id]
        dist.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


class CheckpointEngine:
    """Lazy snapshots into one host cache, streamed per rank to storage, committed by rank 0.

    Thread safety: the public methods are meant for the one training thread of a rank.
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | None = None, *, rank: int | None = None,
                 world_size: int | None = None, run_id: str | None = None):
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(config)
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.rank == 0 and self.config.remove_partial_on_start and self.config.save_dir:
            # Before the run id is agreed (a collective): no rank can have written anything yet.
            removed = retention.remove_partial(self.config.save_dir)
            if removed:
                log.warning("[datastates] removed %d uncommitted checkpoint(s) left by a crash: %s",
                            len(removed), ", ".join(sorted(removed)))
        self.run_id = run_id or _agree_run_id(self.world_size)
        self.use_cuda = torch.cuda.is_available()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._checkpoints: dict[tuple[str, str], CheckpointJob] = {}
        self._committed_ids: set[tuple[str, str]] = set()  # never written again in this run
        self._files: list[FileJob] = []
        self._closed = False
        self.last_load_level: str | None = None
        self.blocked_total_s = 0.0  # all time the caller spent in save() and wait_snapshot()
        self.wait_total_s = 0.0  # the wait_snapshot() part of it

        tele_path = self.config.telemetry_path
        if tele_path is None and self.config.save_dir is not None:
            tele_path = os.path.join(self.config.save_dir, "datastates_telemetry", "rank-{rank:05d}.jsonl")
        self.telemetry = Telemetry(tele_path.format(rank=self.rank) if tele_path else None, self.rank)

        self.cache = HostCache(self.config.host_cache_bytes, self.config.chunk_bytes, pin=self.use_cuda)
        local = self.config.local_dir
        self.committer = Committer(self.rank, self.world_size, self.run_id,
                                   (lambda job: local) if local else (lambda job: None),
                                   self.telemetry, self.config.persist_timeout_s, self._fail, self._raise_if_failed)
        self.stager = None
        if local:
            self.stager = LevelStager(lambda job: local, lambda job: job.checkpoint.root,
                                      self.cache.chunk_bytes, self.config.o_direct, self._on_durable, self._fail)
        self.writer = RankWriter(self.cache, LEVEL_LOCAL if local else LEVEL_SHARED,
                                 (lambda job: local) if local else (lambda job: job.checkpoint.root),
                                 self.config.o_direct, self._on_durable, self._fail)
        self.deleter = retention.Deleter() if self.config.keep_last is not None else None
        self.scheduler = SnapshotScheduler(self.cache, make_copier(self.use_cuda), self._emit_chunk, self._fail,
                                           self._raise_if_failed, self.config.persist_timeout_s)
        self.replicas: PeerReplicas | None = None
        if self.config.peer_replica:  # creates a process group: collective, like the run id above
            self.replicas = PeerReplicas(
                self.rank, self.world_size, self.config.ranks_per_node,
                self.config.replica_dir or default_replica_dir(self.config.save_dir), self.cache.chunk_bytes,
                self.config.persist_timeout_s, LEVEL_LOCAL if local else LEVEL_SHARED,
                (lambda job: local) if local else (lambda job: job.root), self.run_id, self.telemetry,
                self._fail, self._raise_if_failed)
        _live_engines.add(self)

    # ------------------------------------------------------------------ saving
    def save(self, state: Any, checkpoint: str, name: str | None = None, *, root: str | None = None,
             version: int | None = None, extra: dict | None = None) -> FileJob:
        """Record ``state`` for checkpoint ``checkpoint``; returns at once, copies run in the background.

        The tensors must not be modified until ``wait_snapshot`` returns. Non-tensor values are
        encoded now, so later changes to them do not reach the checkpoint. ``extra`` (JSON-able)
        is copied into this file's manifest entry, for adapters that index what each file holds.
        """
        started = time.monotonic()
        self._raise_if_failed()
        if self._closed:
            raise CheckpointError("save() after shutdown()")
        root = self._root(root)
        name = f"rank{self.rank:05d}" if name is None else name
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"file name {name!r} must be non-empty, without '/', not starting with '.'")
        if not checkpoint or checkpoint.startswith(".") or "/" in checkpoint.strip("/"):
            raise ValueError(f"checkpoint id {checkpoint!r} must be one non-hidden directory name")
        self._forget_finished()
        if (root, checkpoint) in self._committed_ids:
            raise CheckpointError(f"checkpoint {checkpoint} was already committed in this run; use a new id")
        job = self._checkpoints.get((root, checkpoint))
        if job is not None and job.commit_requested:
            raise CheckpointError(f"checkpoint {checkpoint} was already committed by this rank; use a new id")
        if job is not None and any(f.name == name for f in job.files):
            raise CheckpointError(f"checkpoint {checkpoint} already has a file named {name!r}")
        if job is not None and job.version != version:
            raise CheckpointError(f"checkpoint {checkpoint}: version {version} differs from {job.version}")

        # Everything that can refuse the state runs before the checkpoint is registered.
        encoder = codec.Encoder(pickle_fallback=self.config.pickle_fallback,
                                object_modules=self.config.object_modules)
        skeleton = encoder.encode(state)
        sidecar = json.dumps({"format": "megatron_ext.state", "state": skeleton},
                             separators=(",", ":")).encode("utf-8")
        plan = file_layout.plan(encoder.tensors, {"checkpoint": checkpoint, "name": name,
                                                  "rank": str(self.rank), "run_id": self.run_id})
        if job is None:
            job = CheckpointJob(checkpoint=checkpoint, root=root, version=version)
            self._checkpoints[(root, checkpoint)] = job
            self.committer.track(job)
        base = f"{checkpoint}/{name}.{self.run_id}"
        fjob = FileJob(checkpoint=job, name=name, layout=plan, sidecar=sidecar,
                       cuda_mark=self.scheduler.copier.mark([t for _, t in encoder.tensors]),
                       tensor_rel=base + ".safetensors", sidecar_rel=base + ".state.json",
                       extra=json.loads(json.dumps(extra)) if extra is not None else None)
        job.files.append(fjob)
        self._files.append(fjob)
        self.scheduler.submit(fjob)
        job.blocked_s += time.monotonic() - started
        self.blocked_total_s += time.monotonic() - started
        return fjob

    def commit(self, checkpoint: str, *, root: str | None = None,
               on_committed: Callable[[dict], None] | None = None) -> CheckpointJob:
        """Declare this rank's files of ``checkpoint`` complete; the commit then happens in the background.

        ``on_committed(manifest)`` runs on every rank once the manifest is durable (a framework's
        "latest" tracker belongs there, written by one rank).
        """
        self._raise_if_failed()
        root = self._root(root)
        job = self._checkpoints.get((root, checkpoint))
        if (root, checkpoint) in self._committed_ids:
            raise CheckpointError(f"checkpoint {checkpoint} was already committed in this run")
        if job is None:  # a rank with nothing to save still takes part in the commit
            job = CheckpointJob(checkpoint=checkpoint, root=root, version=None)
            self._checkpoints[(root, checkpoint)] = job
            self.committer.track(job)
        if on_committed is not None:
            job.on_committed.append(on_committed)
        if self.deleter is not None:
            job.on_committed.append(lambda manifest, root=root: self._apply_retention(root))
        self._request_commit(job)
        self.committer.poke()
        return job

    def _request_commit(self, job: CheckpointJob) -> None:
        if not job.commit_requested and self.replicas is not None:
            self.replicas.submit(job)  # every rank commits the same checkpoints in the same order
        job.commit_requested = True

    def save_and_commit(self, state: Any, checkpoint: str, name: str | None = None, **kwargs: Any) -> CheckpointJob:
        root = kwargs.pop("root", None)
        on_committed = kwargs.pop("on_committed", None)
        self.save(state, checkpoint, name, root=root, **kwargs)
        return self.commit(checkpoint, root=root, on_committed=on_committed)

    # ------------------------------------------------------------------ waiting
    def wait_snapshot(self, timeout: float | None = None) -> float:
        """Block until every pending save is in the host cache; returns the seconds blocked."""
        started = time.monotonic()
        timeout = self.config.snapshot_timeout_s if timeout is None else timeout
        pending = [f for f in self._files if not f.snapshot_done.is_set()]
        for fjob in pending:
            self._wait_event(fjob.snapshot_done, started + timeout, f"snapshot of {fjob.checkpoint.checkpoint}")
        self._raise_if_failed()
        blocked = time.monotonic() - started
        self.blocked_total_s += blocked
        self.wait_total_s += blocked
        for job in {f.checkpoint for f in pending}:
            job.blocked_s += blocked
        self._files = [f for f in self._files if not f.snapshot_done.is_set()]
        return blocked

    def wait_persisted(self, checkpoint: str | None = None, *, root: str | None = None,
                       timeout: float | None = None) -> None:
        """Block until saved files are durable on every level (peer replicas included) and commits are done."""
        deadline = time.monotonic() + (self.config.persist_timeout_s if timeout is None else timeout)
        if checkpoint is not None:
            key = (self._root(root), checkpoint)
            if key not in self._checkpoints:
                raise CheckpointError(f"checkpoint {checkpoint} has nothing pending on rank {self.rank} "
                                      "(never saved here, or already waited for)")
            jobs = [self._checkpoints[key]]
        else:
            jobs = list(self._checkpoints.values())
        for job in jobs:
            if job.commit_requested:
                self._wait_event(job.committed, deadline, f"commit of {job.checkpoint}")
            else:
                while not job.durable_on(LEVEL_SHARED) and job.error is None:
                    self._raise_if_failed()
                    if time.monotonic() > deadline:
                        raise CheckpointError(f"flush of {job.checkpoint} did not finish in time")
                    time.sleep(_POLL_S)
        if self.replicas is not None:
            self.replicas.wait(deadline)
        self._raise_if_failed()
        self._forget_finished()

    def _wait_event(self, event: threading.Event, deadline: float, what: str) -> None:
        while not event.wait(_POLL_S):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise CheckpointError(f"{what} did not finish in time (timeout)")
        self._raise_if_failed()

    # ------------------------------------------------------------------ loading
    def latest(self, root: str | None = None) -> str | None:
        """Id of the newest committed checkpoint under ``root``, or None."""
        committed = list_committed(self._root(root))
        return committed[-1][0] if committed else None

    def load(self, checkpoint: str, name: str | None = None, *, root: str | None = None,
             map_location: Any = None, allow_pickle: bool = False, verify: bool = True,
             level: str = "auto") -> Any:
        """Load one saved state of a committed checkpoint, from the node-local level when complete there."""
        committed = self.open_checkpoint(checkpoint, root=root, verify=verify)
        name = f"rank{self.rank:05d}" if name is None else name
        reader = committed.reader(name, level)
        self.last_load_level = reader.level
        return reader.state(map_location, allow_pickle, self.config.object_modules)

    def open_checkpoint(self, checkpoint: str, *, root: str | None = None, verify: bool = True) -> "CommittedCheckpoint":
        """A committed checkpoint's manifest plus per-file readers, for adapters that read selectively.

        With ``peer_replica`` this is a collective: ranks whose node-local copy is gone fetch
        their files from the peer holding their replica (``replica.py``).
        """
        root = self._root(root)
        path = os.path.join(root, checkpoint)
        problem: CheckpointError | None = None
        try:
            manifest = read_manifest(path)
            if manifest is None:
                problem = CheckpointError(f"{path} is not a committed checkpoint (no manifest)")
        except CheckpointError as exc:
            manifest, problem = None, exc
        recovered: dict[str, str] = {}
        if self.replicas is not None:  # every rank takes part, even one that cannot load
            local = self.config.local_dir
            recovered = self.replicas.recover(checkpoint, manifest, bool(local) and manifest is not None and
                                              restore.local_copy_complete(local, checkpoint, manifest, self.rank))
        if problem is not None:
            raise problem
        return CommittedCheckpoint(root, self.config.local_dir, checkpoint, manifest, verify, recovered)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float | None = None, *, normal_end: bool = True) -> None:
        """Commit whatever was saved, wait until it is durable and committed, stop the threads.

        ``normal_end=False`` (interpreter exit, an exception) keeps the peer replicas this rank
        holds in host memory for a restart; a normal end frees them.
        """
        if self._closed:
            return
        self._closed = True
        timeout = self.config.persist_timeout_s if timeout is None else timeout
        clean = False
        try:
            if self._error is None:
                for job in list(self._checkpoints.values()):
                    self._request_commit(job)
                self.committer.poke()
                self.wait_persisted(timeout=timeout)
                clean = normal_end
        finally:
            if self.replicas is not None:
                self.replicas.close(clean)
            self.scheduler.stop(5)
            self.writer.stop(5)
            if self.stager is not None:
                self.stager.stop(5)
            self.committer.stop(5)
            if self.deleter is not None:
                self.deleter.stop(60)
            self.cache.close()
            _live_engines.discard(self)
        self._raise_if_failed()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            try:
                self.shutdown(normal_end=False)
            except Exception:  # do not hide the exception that ended the block
                traceback.print_exc()

    # ------------------------------------------------------------------ internals
    def _root(self, root: str | None) -> str:
        root = root or self.config.save_dir
        if root is None:
            raise ConfigError("no checkpoint directory: pass root= or set save_dir in the config")
        return os.path.abspath(root)

    def _forget_finished(self) -> None:
        """Drop the records of finished checkpoints (a run may take 100,000), keeping only their ids."""
        for key, job in list(self._checkpoints.items()):
            if job.committed.is_set():
                del self._checkpoints[key]
                self._committed_ids.add(key)

    def _apply_retention(self, root: str) -> None:
        """After a commit: schedule deletion of what the retention policy no longer keeps."""
        committed = [(name, m.get("version")) for name, m in list_committed(root)]
        in_flight = {j.checkpoint for j in list(self._checkpoints.values())
                     if j.root == root and not j.committed.is_set()}
        if self.replicas is not None:  # the replication thread still reads them
            in_flight |= self.replicas.pending()
        for name in retention.to_delete(committed, self.config.keep_last, self.config.keep_every, in_flight):
            if self.rank == 0:
                self.deleter.submit(os.path.join(root, name))
            if self.config.local_dir:
                self.deleter.submit(os.path.join(self.config.local_dir, name))

    def _emit_chunk(self, chunk: Chunk) -> None:
        self.writer.submit(chunk)

    def _on_durable(self, fjob: FileJob, level: str) -> None:
        if level == LEVEL_LOCAL and self.stager is not None:
            self.stager.submit(fjob)
        self.committer.poke()

    def _fail(self, exc: BaseException, job: CheckpointJob | None = None) -> bool:
        """A background thread failed. Returns True if the engine must stop (then every call raises).

        With ``on_failure="continue"`` a failure that belongs to one checkpoint only abandons
        that checkpoint. Either way an error report tells the other ranks at once.
        """
        fatal = job is None or self.config.on_failure == "stop"
        message = f"{type(exc).__name__}: {exc}"
        with self._error_lock:
            if fatal and self._error is None:
                self._error = exc
            if job is not None and job.error is None:
                job.error = exc
        jobs = [job] if job is not None else list(self._checkpoints.values())
        for target in jobs:
            try:
                reports = os.path.join(target.root, target.checkpoint, REPORTS)
                os.makedirs(reports, exist_ok=True)
                atomic_write_json(os.path.join(reports, report_name(self.rank, self.run_id, error=True)),
                                  {"rank": self.rank, "run_id": self.run_id, "error": message})
            except OSError:
                pass  # the file system itself may be what failed; the local error still stands
        if not fatal:
            log.error("[datastates] rank %d: checkpoint %s abandoned, training continues: %s",
                      self.rank, job.checkpoint, message)
            self.telemetry.emit("failed", job.checkpoint, "all", job.nbytes, error=message)
        self.committer.poke()
        return fatal

    def raise_if_failed(self) -> None:
        """Raise, on the caller's thread, the first failure of a background thread (cheap)."""
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"background checkpointing failed on rank {self.rank}: "
                                  f"{type(self._error).__name__}: {self._error}") from self._error


class CommittedCheckpoint:
    """Read side of one committed checkpoint: each file from the node-local level when complete
    there, else from a peer's replica when one was recovered, else from the shared level."""

    def __init__(self, root: str, local_dir: str | None, checkpoint: str, manifest: dict, verify: bool,
                 recovered: dict[str, str] | None = None):
        self.root, self.local_dir, self.checkpoint, self.manifest, self.verify = root, local_dir, checkpoint, manifest, verify
        self.recovered = recovered or {}  # file name -> directory of its verified peer copy
        self._readers: dict[str, restore.FileReader] = {}
        self.levels_used: set[str] = set()

    def reader(self, name: str, level: str = "auto") -> restore.FileReader:
        """The reader of file ``name``: node-local when complete there (``level="local"`` requires it)."""
        if name not in self._readers:
            entry = self.manifest["files"].get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {self.checkpoint} has no file {name!r}; "
                                      f"it has {sorted(self.manifest['files'])[:8]}")
            base, chosen = self.root, LEVEL_SHARED
            if self.local_dir and level in ("auto", LEVEL_LOCAL) and restore.local_copy_complete(
                    self.local_dir, self.checkpoint, self.manifest, entry["rank"]):
                base, chosen = self.local_dir, LEVEL_LOCAL
            elif level == LEVEL_LOCAL:
                raise CheckpointError(f"checkpoint {self.checkpoint} is not complete on the node-local level")
            elif name in self.recovered and level in ("auto", LEVEL_PEER):
                base, chosen = self.recovered[name], LEVEL_PEER
            self.levels_used.add(chosen)
            self._readers[name] = restore.FileReader(base, entry, self.verify, level=chosen)
        return self._readers[name]


def _shutdown_live_engines() -> None:
    """At interpreter exit: the last checkpoint of a run is committed even if nobody waited."""
    for engine in list(_live_engines):
        try:
            engine.shutdown(normal_end=False)
        except Exception:
            traceback.print_exc()


atexit.register(_shutdown_live_engines)

__all__ = ["CheckpointEngine", "CheckpointError", "EngineConfig", "ConfigError", "check_writable_dir"]
