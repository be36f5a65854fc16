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
import hashlib
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

from . import codec, layout as file_layout, lock as dir_lock, restore, retention
from .commit import Committer, read_skip_report, report_name, skip_report_name, REPORTS
from .config import ConfigError, EngineConfig, OVERLOAD_SUPERSEDE, OVERLOAD_WAIT, check_writable_dir
from .manifest import RUN_ID, TensorIndex, list_committed, read_manifest, run_of, valid_name
from .copier import make_copier
from .files import atomic_write_json
from .flush import LevelStager, RankWriter
from .host_cache import HostCache
from .jobs import CheckpointError, CheckpointJob, CheckpointSkipped, FileJob, LEVEL_LOCAL, LEVEL_PEER, LEVEL_SHARED
from .replica import PeerReplicas, default_replica_dir
from .snapshot import Chunk, Discard, SnapshotScheduler
from .telemetry import Telemetry

_POLL_S = 0.05
log = logging.getLogger("megatron_ext.engine")
_live_engines: "weakref.WeakSet[CheckpointEngine]" = weakref.WeakSet()


def _default_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def attempt_tag(run_id: str, checkpoint: str, attempt: int) -> str:
    """The tag of the ``attempt``-th save of ``checkpoint`` in run ``run_id`` (0: the run id itself).

    Every rank derives the same tag, so a checkpoint id saved again in one run (Megatron-LM does,
    on a batch-size ramp-up step or for its rerun state machine) gets new file names: the files
    of the committed attempt stay untouched until the new manifest replaces the old one.
    """
    if attempt == 0:
        return run_id
    return hashlib.sha1(f"{run_id}/{checkpoint}/{attempt}".encode()).hexdigest()[:12]


def _broadcast_from_zero(values: list) -> list:
    """Rank 0's ``values`` on every rank (one small collective at start-up)."""
    import torch.distributed as dist

    box = list(values)
    dist.broadcast_object_list(box, src=0)
    return box


def _any_rank_failed(failed: bool) -> bool:
    """Whether any rank failed (one all-reduce at start-up), so every rank stops together."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class CheckpointEngine:
    """Lazy snapshots into one host cache, streamed per rank to storage, committed by rank 0.

    Thread safety: the public methods are meant for the one training thread of a rank.
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | None = None, *, rank: int | None = None,
                 world_size: int | None = None, run_id: str | None = None, read_only: bool = False):
        """``read_only`` engines only load: they take no lock, create and remove nothing, and refuse to save.

        Otherwise the job locks ``save_dir`` (rank 0) and ``local_dir`` (every node) for the
        engine's life (lock.py); another job's lock is an error at start-up on every rank.
        """
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(config, probe=False)
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside world of size {self.world_size}")
        if run_id is not None and (type(run_id) is not str or not RUN_ID.fullmatch(run_id)):
            raise ConfigError(f"run_id {run_id!r} must be 12 lowercase hex digits")
        self.read_only = read_only
        self.classes = self.config.allowed_classes()  # safe_classes, resolved once
        if not read_only:
            self.config.validate(self.rank)
        self._locks: dict[str, dir_lock.DirectoryLock] = {}  # root -> lock, on rank 0
        self._runs_of_root: dict[str, set[str]] = {}  # root -> runs whose checkpoints retention may remove
        self._manifests_seen: dict[str, dict] = {}  # root -> list_committed's cache, for retention
        self.local_lock: dir_lock.DirectoryLock | None = None
        self.run_id = self._start(run_id)
        try:
            self._build()
        except BaseException:
            self._release_locks()
            raise

    def _build(self) -> None:
        """State, threads and host cache (after the locks: a failure here releases them)."""
        read_only = self.read_only
        self.use_cuda = torch.cuda.is_available()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._checkpoints: dict[tuple[str, str], CheckpointJob] = {}
        self._committed_ids: set[tuple[str, str]] = set()  # committed in this run (saving again: a new attempt)
        self._attempts: dict[tuple[str, str], int] = {}  # checkpoints saved more than once in this run
        self._files: list[FileJob] = []
        self._closed = False
        self.last_load_level: str | None = None
        self.blocked_total_s = 0.0  # all time the caller spent in save() and wait_snapshot()
        self.wait_total_s = 0.0  # the wait_snapshot() part of it
        # Overload (see wait_snapshot): calls of wait_snapshot that waited for the flush to free
        # cache space, and how long; saves the durable-age bound turned from supersede to wait.
        self.backpressure_waits = 0
        self.backpressure_wait_s = 0.0
        self.age_bound_waits = 0
        self._newest_durable: int | None = None  # newest version committed in this run
        self._first_version: int | None = None
        # Guards the moves of a checkpoint that exclude each other: flush started, reported, skipped.
        self._state_lock = threading.Lock()

        self.telemetry = Telemetry(None if read_only else self.config.telemetry_file(self.rank), self.rank)

        self.cache = HostCache(self.config.host_cache_bytes, self.config.chunk_bytes, pin=self.use_cuda)
        local = self.config.local_dir
        self.committer = Committer(self.rank, self.world_size, self.run_id,
                                   (lambda job: local) if local else (lambda job: None),
                                   self.telemetry, self.config.persist_timeout_s, self._fail, self._raise_if_failed,
                                   self._state_lock, self._abandon_for_peer, may_remove=self._holds_lock)
        self.stager = None
        if local:
            self.stager = LevelStager(lambda job: local, lambda job: job.checkpoint.root,
                                      self.cache.chunk_bytes, self.config.o_direct, self._on_durable, self._fail)
        self.writer = RankWriter(self.cache, LEVEL_LOCAL if local else LEVEL_SHARED,
                                 (lambda job: local) if local else (lambda job: job.checkpoint.root),
                                 self.config.o_direct, self._on_durable, self._fail, self._state_lock,
                                 self.stager.submit if self.stager is not None else (lambda job: None))
        self.deleter: retention.Deleter | None = None  # started by the first retention that deletes
        self.scheduler = SnapshotScheduler(self.cache, make_copier(self.use_cuda), self._emit_chunk, self._fail,
                                           self._raise_if_failed, self.config.persist_timeout_s,
                                           self._supersede_older, self._settle_skipped)
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
        name = f"rank{self.rank:05d}" if name is None else name
        if not valid_name(name) or len(name) > 200:
            raise ValueError(f"file name {name!r} must be non-empty, at most 200 characters, without '/', "
                             "not starting with '.'")
        if not valid_name(checkpoint):
            raise ValueError(f"checkpoint id {checkpoint!r} must be one non-hidden directory name")
        root = self._writable_root(root)
        job = self._open_job(root, checkpoint)
        if job is not None and any(f.name == name for f in job.files):
            raise CheckpointError(f"checkpoint {checkpoint} already has a file named {name!r}")
        if job is not None and job.version != version:
            raise CheckpointError(f"checkpoint {checkpoint}: version {version} differs from {job.version}")
        policy = self._overload_policy_for(version) if job is None else job.policy

        # Everything that can refuse the state runs before the checkpoint is registered.
        encoder = codec.Encoder(pickle_fallback=self.config.pickle_fallback, classes=self.classes)
        skeleton = encoder.encode(state)
        sidecar = json.dumps({"format": "megatron_ext.state", "state": skeleton},
                             separators=(",", ":")).encode("utf-8")
        tag = job.tag if job is not None else self._tag(root, checkpoint)
        plan = file_layout.plan(encoder.tensors, {"checkpoint": checkpoint, "name": name,
                                                  "rank": str(self.rank), "run_id": tag})
        if job is None:
            if policy == OVERLOAD_SUPERSEDE:
                self._before_superseding_save()
            if self._first_version is None:
                self._first_version = version
            job = CheckpointJob(checkpoint=checkpoint, root=root, version=version, tag=tag, policy=policy)
            if policy == OVERLOAD_SUPERSEDE:
                self._supersede_queued(job)
            if policy == OVERLOAD_WAIT and self.config.overload_policy == OVERLOAD_SUPERSEDE:
                self.age_bound_waits += 1
            self._checkpoints[(root, checkpoint)] = job
            self.committer.track(job)
        base = f"{checkpoint}/{name}.{tag}"
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
               on_committed: Callable[[dict], None] | None = None, keep_last: int | None = None) -> CheckpointJob:
        """Declare this rank's files of ``checkpoint`` complete; the commit then happens in the background.

        ``on_committed(manifest)`` runs on every rank once the manifest is durable (a framework's
        "latest" tracker belongs there, written by one rank). ``keep_last`` applies retention to
        this checkpoint's root with that bound instead of the configured one (a root of
        short-lived checkpoints, such as Megatron-LM's non-persistent ones, keeps only the newest).
        """
        self._raise_if_failed()
        root = self._writable_root(root)
        job = self._open_job(root, checkpoint)
        if job is None:  # a rank with nothing to save still takes part in the commit
            job = CheckpointJob(checkpoint=checkpoint, root=root, version=None, tag=self._tag(root, checkpoint))
            self._checkpoints[(root, checkpoint)] = job
            self.committer.track(job)
        job.on_committed.append(self._note_durable)
        if on_committed is not None:
            job.on_committed.append(on_committed)
        if keep_last is not None or self.config.keep_last is not None:
            job.on_committed.append(lambda manifest, root=root: self._apply_retention(root, keep_last))
        self._request_commit(job)
        self.committer.poke()
        return job

    def _open_job(self, root: str, checkpoint: str) -> CheckpointJob | None:
        """The job still open for new files of ``checkpoint``, or None (then the caller starts one).

        A checkpoint already committed, or whose commit was requested, in this run is saved again
        as a new attempt: first the earlier attempt is waited for (its commit stays valid until the
        new one replaces it), then the new attempt gets its own tag. Every rank saves and commits
        the same checkpoints in the same order, so every rank counts the same attempts.
        """
        key = (root, checkpoint)
        self._forget_finished()
        job = self._checkpoints.get(key)
        if job is not None and not job.commit_requested:
            return job
        if job is None and key not in self._committed_ids:
            return None
        log.info("[datastates] rank %d: %s is saved again in this run; waiting for the earlier save to commit",
                 self.rank, checkpoint)
        if job is not None:
            self.wait_persisted(checkpoint, root=root)
        self._committed_ids.discard(key)
        self._attempts[key] = self._attempts.get(key, 0) + 1
        return None

    def _tag(self, root: str, checkpoint: str) -> str:
        return attempt_tag(self.run_id, checkpoint, self._attempts.get((root, checkpoint), 0))

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
        """Block until every pending save is in the host cache (or skipped); returns the seconds blocked.

        Under ``overload_policy="wait"`` this may wait for the flush to free cache space
        (backpressure, counted in ``backpressure_waits``). Under "supersede" it waits only for
        copies that have cache space (memory speed): a snapshot found waiting for space is
        abandoned instead, its checkpoint skipped on every rank.
        """
        started = time.monotonic()
        timeout = self.config.snapshot_timeout_s if timeout is None else timeout
        pending = [f for f in self._files if not f.snapshot_done.is_set()]
        progress = self.scheduler.progress
        waited_for_flush = False
        for fjob in pending:
            what = f"snapshot of {fjob.checkpoint.checkpoint}"
            while True:
                progress.clear()
                if fjob.snapshot_done.is_set():
                    break
                self._raise_if_failed()
                if time.monotonic() > started + timeout:
                    raise CheckpointError(f"{what} did not finish in time (timeout)")
                starved = self.scheduler.starved is fjob
                if starved and fjob.checkpoint.policy == OVERLOAD_SUPERSEDE:
                    self._skip(fjob.checkpoint, "no_cache_space")
                    self.cache.wake()  # the copy gives up at once and releases the tensors
                    fjob.snapshot_done.wait(_POLL_S)
                    continue
                t0 = time.monotonic()
                progress.wait(_POLL_S)
                if starved:
                    waited_for_flush = True
                    self.backpressure_wait_s += time.monotonic() - t0
        self.backpressure_waits += waited_for_flush
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
                self._wait_event(job.committed, deadline, f"commit of {job.checkpoint}",
                                 lambda job=job: job.commit_waiting_for)
            else:
                while not job.durable_on(LEVEL_SHARED) and not job.abandoned:
                    self._raise_if_failed()
                    if time.monotonic() > deadline:
                        raise CheckpointError(f"flush of {job.checkpoint} did not finish in time")
                    time.sleep(_POLL_S)
        if self.replicas is not None:
            self.replicas.wait(deadline)
        self._raise_if_failed()
        self._forget_finished()

    def _wait_event(self, event: threading.Event, deadline: float, what: str,
                    waiting_for: Callable[[], Callable[[], str] | None] = lambda: None) -> None:
        while not event.wait(_POLL_S):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                describe = waiting_for()
                reason = f": {describe()}" if describe is not None else ""
                raise CheckpointError(f"{what} did not finish in time (timeout){reason}")
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
        return reader.state(map_location, allow_pickle)

    def load_into(self, checkpoint: str, template: Any, name: str | None = None, *, root: str | None = None,
                  allow_pickle: bool = False, verify: bool = True, level: str = "auto") -> Any:
        """Like ``load``, but the tensors are read into those of ``template`` (a state of the same structure,
        e.g. the live model's), through the host cache: no new tensor memory to fault in."""
        committed = self.open_checkpoint(checkpoint, root=root, verify=verify)
        reader = committed.reader(f"rank{self.rank:05d}" if name is None else name, level)
        self.last_load_level = reader.level
        return reader.state_into(template, allow_pickle)

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
        return CommittedCheckpoint(root, self.config.local_dir, checkpoint, manifest, verify, self.config, self.cache,
                                  recovered, self.classes)

    def agree_load_level(self, committed: "CommittedCheckpoint") -> str:
        """Collective over all ranks: read node-local only if every rank's own files are complete there.

        One all_reduce (MIN) of "my files are on my node-local level"; returns the level chosen
        ("local" or "shared") and makes ``committed``'s readers use it.
        """
        local = int(committed.local_copy_complete(self.rank))
        if self.world_size > 1:
            import torch.distributed as dist

            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            flag = torch.tensor([local], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            local = int(flag.item())
        committed.use_level("auto" if local else LEVEL_SHARED)
        level = LEVEL_LOCAL if local else LEVEL_SHARED
        log.info("[datastates] rank %d reads %s from the %s level", self.rank, committed.checkpoint, level)
        return level

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
            self._release_locks()
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
    @property
    def newest_durable_version(self) -> int | None:
        """Version of the newest checkpoint committed in this run (what ``max_durable_age`` measures from)."""
        return self._newest_durable

    def _root(self, root: str | None) -> str:
        root = root or self.config.save_dir
        if root is None:
            raise ConfigError("no checkpoint directory: pass root= or set save_dir in the config")
        return os.path.abspath(root)

    def _writable_root(self, root: str | None) -> str:
        """The root a save or commit goes to; on rank 0 the job's lock on it (taken at first use)."""
        if self.read_only:
            raise CheckpointError("this engine was opened read_only: it loads, it does not save")
        root = self._root(root)
        if self.rank == 0 and root not in self._locks:
            try:
                os.makedirs(root, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(f"cannot create checkpoint directory {root}: {exc.strerror or exc}") from None
            self._locks[root] = dir_lock.acquire(root, self.run_id, "checkpoint directory")
        return root

    def _start(self, run_id: str | None) -> str:
        """Agree on the run id, lock ``save_dir`` (rank 0) and ``local_dir`` (each node), remove crashed partials.

        Rank 0 locks before any rank can write; with torch.distributed the outcome travels with
        the run id, so a refused job stops on every rank at once, with the holder's name.
        """
        collective = run_id is None and self.world_size > 1
        run_id = run_id or uuid.uuid4().hex[:12]
        problem: str | None = None
        save_dir = os.path.abspath(self.config.save_dir) if self.config.save_dir else None
        if self.rank == 0 and save_dir and not self.read_only:
            try:
                self._locks[save_dir] = lock = dir_lock.acquire(save_dir, run_id, "save_dir")
                if self.config.remove_partial_on_start and lock.held:
                    removed = retention.remove_partial(save_dir)
                    if removed:
                        log.warning("[datastates] removed %d uncommitted checkpoint(s) left by a crash or skipped: %s",
                                    len(removed), ", ".join(sorted(removed)))
            except CheckpointError as exc:
                problem = str(exc)
        if collective:
            run_id, problem = _broadcast_from_zero([run_id, problem])
        if problem is not None:
            self._release_locks()
            raise dir_lock.LockedError(problem if self.rank == 0 else f"rank 0 could not start: {problem}")
        if self.config.local_dir and not self.read_only:
            failure: CheckpointError | None = None
            try:
                self.local_lock = dir_lock.acquire(os.path.abspath(self.config.local_dir), run_id, "local_dir",
                                                   same_run_ok=True)
            except CheckpointError as exc:
                failure = exc
            if (_any_rank_failed(failure is not None) if collective else failure is not None):
                self._release_locks()
                raise failure or dir_lock.LockedError("local_dir is locked by another job on another node")
        return run_id

    def _holds_lock(self, root: str) -> bool:
        """Whether this rank may remove things under ``root``: it holds the lock of that directory."""
        lock = self._locks.get(os.path.abspath(root))
        return lock is not None and lock.held

    def _release_locks(self) -> None:
        for lock in list(self._locks.values()) + ([self.local_lock] if self.local_lock else []):
            lock.release()

    def _retention_runs(self, root: str) -> set[str]:
        """Runs whose checkpoints under ``root`` retention may remove: those that held its lock."""
        lock = self._locks.get(root)
        if lock is not None:
            return set(lock.runs) if lock.held else set()
        if root not in self._runs_of_root:  # other ranks: the lock file's record, read once
            self._runs_of_root[root] = set(dir_lock.runs_of(root)) | {self.run_id}
        return self._runs_of_root[root]

    def _forget_finished(self) -> None:
        """Drop the records of finished checkpoints (a run may take 100,000), keeping only their ids."""
        for key, job in list(self._checkpoints.items()):
            if job.committed.is_set():
                del self._checkpoints[key]
                self._committed_ids.add(key)

    def _apply_retention(self, root: str, keep_last: int | None = None) -> None:
        """After a commit: schedule deletion of what the retention policy no longer keeps.

        Only checkpoints of runs that held ``root``'s lock count (never another job's, never a copy
        brought in from elsewhere), and only a holder of a directory's lock removes anything there.
        """
        runs = self._retention_runs(root)
        cache = self._manifests_seen.setdefault(root, {})
        ours = [(name, m) for name, m in list_committed(root, cache) if run_of(m) in runs]
        in_flight = {j.checkpoint for j in list(self._checkpoints.values())
                     if j.root == root and not j.committed.is_set()}
        if self.replicas is not None:  # the replication thread still reads them
            in_flight |= self.replicas.pending()
        owner = {name: m["run_id"] for name, m in ours}
        local = self.config.local_dir if self.local_lock is not None and self.local_lock.job_holds else None
        keep_every = self.config.keep_every if keep_last is None else None
        keep_last = self.config.keep_last if keep_last is None else keep_last
        for name in retention.to_delete([(n, m["version"]) for n, m in ours], keep_last, keep_every, in_flight):
            if self.deleter is None:
                self.deleter = retention.Deleter()
            if self._holds_lock(root):
                self.deleter.submit(retention.Removal(os.path.join(root, name), owner[name]))
            if local:
                self.deleter.submit(retention.Removal(os.path.join(local, name), None))

    # ------------------------------------------------------------------ overload (supersede)
    def _overload_policy_for(self, version: int | None) -> str:
        """This new checkpoint's policy: the configured one, unless the durable-age bound forces a wait."""
        if self.config.overload_policy != OVERLOAD_SUPERSEDE or self.config.max_durable_age is None:
            return self.config.overload_policy
        if version is None:
            raise CheckpointError("max_durable_age needs a version on every save (pass version=)")
        first = version if self._first_version is None else self._first_version
        newest = self._newest_durable if self._newest_durable is not None else first - 1
        return OVERLOAD_WAIT if version - newest > self.config.max_durable_age else OVERLOAD_SUPERSEDE

    def _note_durable(self, manifest: dict) -> None:
        version = manifest.get("version")
        if version is not None and (self._newest_durable is None or version > self._newest_durable):
            self._newest_durable = version

    def _skip(self, job: CheckpointJob, reason: str, superseded_by: CheckpointJob | None = None,
              unstarted_only: bool = False) -> bool:
        """Decide here to abandon ``job`` (never committed, files removed); False if too late for that.

        Allowed only before this rank reported the checkpoint (and, with ``unstarted_only``,
        before its flush started); the skip report then makes every other rank abandon it too.
        """
        with self._state_lock:
            if job.reported or (unstarted_only and any(f.flush_started for f in job.files)):
                return False
            info = {"reason": reason, "by_rank": self.rank,
                    "superseded_by": superseded_by.checkpoint if superseded_by else None,
                    "superseded_by_version": superseded_by.version if superseded_by else None}
            if not self._mark_skipped(job, info):
                return False
        self._after_skip(job)
        return True

    def _skip_for_peer(self, job: CheckpointJob, report: dict) -> None:
        """Another rank's skip report names ``job``: abandon it here too, whatever its state short of committed."""
        info = {"reason": f"skipped by rank {report.get('rank')}: {report.get('reason')}",
                "by_rank": report.get("rank"), "superseded_by": report.get("superseded_by"),
                "superseded_by_version": report.get("superseded_by_version")}
        with self._state_lock:
            if not self._mark_skipped(job, info):
                return
        self._after_skip(job)

    @staticmethod
    def _mark_skipped(job: CheckpointJob, info: dict) -> bool:
        """Under the state lock: record the skip unless the checkpoint is already settled."""
        if job.abandoned or job.committed.is_set():
            return False
        job.skipped = info
        return True

    def _after_skip(self, job: CheckpointJob) -> None:
        """Telemetry, then the skip report and file removal once no copy of it is left in progress."""
        self.telemetry.emit("skipped", job.checkpoint, "all", job.nbytes, version=job.version, **job.skipped)
        self._settle_skipped(job)
        self.committer.poke()

    def _settle_skipped(self, job: CheckpointJob) -> None:
        """Once the scheduler is done with every file of a skipped checkpoint: tell the peers, drop its files.

        Runs on the snapshot thread (or the thread that skipped it, when all its copies were
        done), so the skip report never costs the training thread a file write.
        """
        if job.skipped is None or not all(f.snapshot_done.is_set() for f in job.files):
            return
        with self._state_lock:
            if job.discard_sent:
                return
            job.discard_sent = True
        if job.skipped["by_rank"] == self.rank:
            reports = os.path.join(job.root, job.checkpoint, REPORTS)
            os.makedirs(reports, exist_ok=True)
            atomic_write_json(os.path.join(reports, skip_report_name(self.rank, job.tag)),
                              {"rank": self.rank, "run_id": job.tag, "version": job.version, **job.skipped})
        self.writer.submit(Discard(job))  # behind the checkpoint's last chunk: removes its files

    def _supersede_older(self, newer: CheckpointJob) -> None:
        """Snapshot thread, cache full: drop older checkpoints whose flush has not started."""
        for job in list(self._checkpoints.values()):
            if job is newer:
                return
            if job.committed.is_set() or not all(f.snapshot_done.is_set() for f in job.files):
                continue
            if self._skip(job, "superseded", superseded_by=newer, unstarted_only=True):
                self.writer.take_back(job)

    def _supersede_queued(self, newer: CheckpointJob) -> None:
        """A new save while the snapshot thread waits for cache space: older snapshots not done are dropped.

        They are queued behind the full cache (or are the copy waiting in it); the newer state
        replaces them, so neither the copy thread nor a later ``wait_snapshot`` waits for them.
        """
        if self.scheduler.starved is None:
            return
        for job in list(self._checkpoints.values()):
            if job is not newer and not all(f.snapshot_done.is_set() for f in job.files):
                self._skip(job, "superseded", superseded_by=newer)
        self.cache.wake()

    def _abandon_for_peer(self, job: CheckpointJob, exc: CheckpointSkipped) -> None:
        """Committer thread: another rank skipped ``job``; drop it here as well."""
        self._skip_for_peer(job, exc.report)

    def _before_superseding_save(self) -> None:
        """Drop in-flight checkpoints another rank skipped, so their flush does not delay newer ones."""
        for job in list(self._checkpoints.values()):
            if not job.abandoned and not job.committed.is_set():
                detail = read_skip_report(os.path.join(job.root, job.checkpoint, REPORTS), job.tag)
                if detail is not None:
                    self._skip_for_peer(job, detail)

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
    there, else from a peer's replica when one was recovered, else from the shared level.

    A multi-rank job should agree on node-local or shared for all ranks (``local_copy_complete``
    on every rank, reduced with MIN, then ``use_level``): a mix would read some ranks' files from a
    node-local copy that another rank may never have finished. Peer copies were verified against
    the manifest when recovered and are used under either choice.
    """

    def __init__(self, root: str, local_dir: str | None, checkpoint: str, manifest: dict, verify: bool,
                 config: EngineConfig | None = None, staging: HostCache | None = None,
                 recovered: dict[str, str] | None = None, classes: Mapping[codec.ClassKey, type] | None = None):
        """``manifest`` must come from ``read_manifest`` (validated); ``classes`` extend the allow-list."""
        self.root, self.local_dir, self.checkpoint, self.manifest, self.verify = root, local_dir, checkpoint, manifest, verify
        self.classes = classes
        config = config or EngineConfig()
        self._read_options = {"threads": config.restore_threads, "o_direct": config.o_direct,
                              "timeout_s": config.persist_timeout_s, "staging": staging}
        self.recovered = recovered or {}  # file name -> directory of its verified peer copy
        self.index = TensorIndex(os.path.join(root, checkpoint), manifest)  # each rank report read once
        self._readers: dict[str, restore.FileReader] = {}
        self.levels_used: set[str] = set()
        self.default_level = "auto"

    def local_copy_complete(self, rank: int) -> bool:
        """Whether ``rank``'s files of this checkpoint are all on this node's local level."""
        return bool(self.local_dir) and restore.local_copy_complete(self.local_dir, self.checkpoint,
                                                                    self.manifest, rank)

    def use_level(self, level: str) -> None:
        """Level for readers created from now on: "shared" always, "auto" node-local where complete."""
        if level not in ("auto", LEVEL_SHARED):
            raise ValueError(f"level must be \"auto\" or \"shared\", got {level!r}")
        self.default_level = level

    def entry(self, name: str) -> dict:
        """File ``name``'s manifest entry with its tensors (from its rank's report in format 2)."""
        return self.index.entry(name)

    def reader(self, name: str, level: str = "auto") -> restore.FileReader:
        """The reader of file ``name``: node-local when complete there (``level="local"`` requires it)."""
        if name not in self._readers:
            entry = self.manifest["files"].get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {self.checkpoint} has no file {name!r}; "
                                      f"it has {sorted(self.manifest['files'])[:8]}")
            asked = level
            if level == "auto":
                level = self.default_level
            base, chosen = self.root, LEVEL_SHARED
            if level in ("auto", LEVEL_LOCAL) and self.local_copy_complete(entry["rank"]):
                base, chosen = self.local_dir, LEVEL_LOCAL
            elif level == LEVEL_LOCAL:
                raise CheckpointError(f"checkpoint {self.checkpoint} is not complete on the node-local level")
            elif name in self.recovered and asked in ("auto", LEVEL_PEER):
                base, chosen = self.recovered[name], LEVEL_PEER
            self.levels_used.add(chosen)
            entry = self.index.entry(name)
            self._readers[name] = restore.FileReader(base, entry, self.verify, level=chosen, run_id=self.manifest["run_id"],
                                                     classes=self.classes, **self._read_options)
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
