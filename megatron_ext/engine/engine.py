"""``CheckpointEngine``: the public face of the lazy asynchronous multi-level checkpoint engine.

The public calls live here: ``save`` (bookkeeping only, on the caller's thread), ``commit``,
``wait_snapshot`` (called right before the training loop mutates the saved tensors, and nothing
else), ``wait_persisted``, the loads and ``shutdown``. The save stages are built once by
``save.pipeline.SavePipeline``; the overload decisions are in save/overload.py, the read side in read/committed.py.

The engine knows nothing of Megatron or DeepSpeed: nested states of tensors in, files out.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable, Mapping

import torch

from . import faults
from .config import EngineConfig, check_retention_count
from .device import rank_device
from .object_store import resolve_root
from .errors import CheckpointError, ConfigError
from .format.catalog import list_committed
from .format.names import RUN_ID
from .host_cache import HostCache
from .read.committed import CommittedCheckpoint, ReadOptions, open_committed
from .save.flow.copy_gate import CopyGate
from .save.flow.file_plan import PlannedFile, check_names
from .save.job.table import JobTable
from .save.job.jobs import CheckpointJob, FileJob
from .save.lifecycle.ownership import DirectoryOwnership
from .save.pipeline import SavePipeline
from .save.lifecycle.space import recheck_full
from .telemetry import Telemetry

log = logging.getLogger("megatron_ext.engine")
#: Engines not shut down yet, held here (not weakly) until ``shutdown``: an engine its caller dropped
#: still commits its last checkpoint at interpreter exit (no stage thread holds the engine itself).
_live_engines: "set[CheckpointEngine]" = set()


def _default_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointEngine:
    """Lazy snapshots into one host cache, streamed per rank to storage, committed by rank 0.

    Thread safety: the public methods are meant for the one training thread of a rank.
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | None = None, *, rank: int | None = None,
                 world_size: int | None = None, run_id: str | None = None, read_only: bool = False,
                 commit_store: Any = None):
        """``read_only`` engines only load: they take no lock, create and remove nothing, and refuse to save.

        Ranks agree on commits through ``commit_store`` (a ``torch.distributed`` Store), by default
        the process group's own; only ranks that share a process without one pass it.

        Otherwise the job locks ``save_dir`` (rank 0) and ``local_dir`` (every node) for the
        engine's life (lock.py); another job's lock is an error at start-up on every rank.
        """
        self.config = (config.check_node() if isinstance(config, EngineConfig)
                       else EngineConfig.from_dict(config, probe=False))
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside world of size {self.world_size}")
        if run_id is not None and (type(run_id) is not str or not RUN_ID.fullmatch(run_id)):
            raise ConfigError(f"run_id {run_id!r} must be 12 lowercase hex digits")
        self.read_only = read_only
        self._commit_store = commit_store
        self.classes = self.config.allowed_classes()  # safe_classes, resolved once
        # A directory found full is probed again once crashed saves' partial files are gone (space.py).
        full = self.config.validate(self.rank, full_ok=True) if not read_only else []
        self.ownership = DirectoryOwnership(self.config, self.rank, self.world_size, read_only)
        self.run_id = self.ownership.start(run_id)
        try:
            if full:
                recheck_full(self.config, full, self.rank, self.ownership.freed_bytes)
            self._build()
        except BaseException:
            self.ownership.release()
            raise

    def _build(self) -> None:
        """State, threads and host cache (after the locks: a failure here releases them)."""
        self.use_cuda = torch.cuda.is_available()
        # The rank's CUDA device, current on this (the training) thread: every engine thread that
        # touches CUDA binds to it, not to GPU 0 (device.py). None without CUDA.
        self.device = rank_device()
        self.jobs = JobTable(self.run_id)
        self._files: list[FileJob] = []  # saved files whose snapshot wait_snapshot has not seen done
        self._plans: dict[str, Any] = {}  # file name -> its last ``reuse`` save's plan (file_plan.ReusablePlan)
        self.plan_reuses = 0  # saves that reused the layout of the file's previous save
        self.views_renewed = 0  # tensors of those that got a new view (their memory moved)
        self._closed = False
        self.last_load_level: str | None = None
        self.blocked_total_s = 0.0  # all time the caller spent in save() and wait_snapshot()
        self.wait_total_s = 0.0  # the wait_snapshot() part of it
        self.telemetry = Telemetry(None if self.read_only else self.config.telemetry_file(self.rank), self.rank)
        self.cache = HostCache(self.config.host_cache_bytes, self.config.chunk_bytes, pin=self.use_cuda,
                               device=self.device)
        self.pipeline = pipeline = SavePipeline.build(
            self.config, rank=self.rank, world_size=self.world_size, run_id=self.run_id, jobs=self.jobs,
            ownership=self.ownership, telemetry=self.telemetry, cache=self.cache, device=self.device,
            use_cuda=self.use_cuda, commit_store=self._commit_store, read_only=self.read_only)
        # The stages the public calls talk to (and tests look at).
        self.save_context, self.failures, self.channel = pipeline.context, pipeline.failures, pipeline.channel
        self.skips, self.scheduler, self.committer = pipeline.skips, pipeline.scheduler, pipeline.committer
        self.retention, self.replicas = pipeline.retention, pipeline.replicas
        _live_engines.add(self)

    # ------------------------------------------------------------------ saving
    def save(self, state: Any, checkpoint: str, name: str | None = None, *, root: str | None = None,
             version: int | None = None, extra: dict | None = None, gate: CopyGate | None = None,
             reuse: bool = False) -> FileJob:
        """Record ``state`` for checkpoint ``checkpoint``; returns at once, copies run in the background.

        The tensors must not be modified until ``wait_snapshot`` returns. Non-tensor values are
        encoded now (save/flow/file_plan.py). ``extra`` (JSON-able)
        is copied into this file's manifest entry, for adapters that index what each file holds.
        ``gate``: the copies wait until it opens (tensors a collective is still filling in).

        ``reuse``: keep this file's plan (its tensors' views and layout, ``file_plan.ReusablePlan``)
        and reuse it at the next ``reuse`` save of a file of the same name whose tensors have the same
        names, shapes and dtypes (a training loop saving the same model again): each tensor in the
        same memory with the same strides keeps its view, the others get a new one; any other
        difference plans the file afresh. The kept views hold the tensors' memory until that next
        save or ``shutdown``.
        """
        started = time.monotonic()
        self.failures.check()
        if self._closed:
            raise CheckpointError("save() after shutdown()")
        name = f"rank{self.rank:05d}" if name is None else name
        check_names(checkpoint, name)
        root = self._writable_root(root)
        job = self._open_job(root, checkpoint)
        if job is not None and any(f.name == name for f in job.files):
            raise CheckpointError(f"checkpoint {checkpoint} already has a file named {name!r}")
        if job is not None and job.version != version:
            raise CheckpointError(f"checkpoint {checkpoint}: version {version} differs from {job.version}")
        tag = job.tag if job is not None else self.jobs.tag(root, checkpoint)
        planned = PlannedFile.encode(state, checkpoint, name, self.rank, tag,
                                     pickle_fallback=self.config.pickle_fallback, classes=self.classes,
                                     previous=self._plans.get(name) if reuse else None, reusable=reuse)
        self._plans.pop(name, None)
        if planned.plan is not None:
            self._plans[name] = planned.plan
        self.plan_reuses += planned.reused
        self.views_renewed += planned.renewed
        if job is None:
            job = self.skips.new_job(root, checkpoint, version, tag)  # its policy under a full cache
            self.committer.track(self.jobs.add(job))
        fjob = planned.file_job(job, self.scheduler.copier, faults.held(gate), extra)
        job.add_file(fjob)
        self._files.append(fjob)
        self.scheduler.submit(fjob)
        took = time.monotonic() - started
        job.add_blocked(started, took)
        self.blocked_total_s += took
        faults.stop_point("after_save")
        return fjob

    def commit(self, checkpoint: str, *, root: str | None = None,
               on_committed: Callable[[dict], None] | None = None, keep_last: int | None = None) -> CheckpointJob:
        """Declare this rank's files of ``checkpoint`` complete; the commit then happens in the background.

        ``on_committed(manifest)`` runs on every rank once the manifest is durable (a framework's
        "latest" tracker belongs there, written by one rank). ``keep_last`` applies retention to
        this checkpoint's root with that bound instead of the configured one (a root of
        short-lived checkpoints, such as Megatron-LM's non-persistent ones, keeps only the newest).
        """
        check_retention_count("keep_last", keep_last)  # before anything is queued: a bad one is refused here
        self.failures.check()
        root = self._writable_root(root)
        job = self._open_job(root, checkpoint)
        if job is None:  # a rank with nothing to save still takes part in the commit
            job = CheckpointJob(checkpoint=checkpoint, root=root, version=None, tag=self.jobs.tag(root, checkpoint))
            self.committer.track(self.jobs.add(job))
        retain = keep_last is not None or self.config.keep_last is not None
        self._request_commit(job, on_committed, keep_last, retain)
        self.committer.poke()
        return job

    def _open_job(self, root: str, checkpoint: str) -> CheckpointJob | None:
        """The job still open for new files of ``checkpoint``, or None; saving a checkpoint id again
        in this run first waits for the earlier attempt to commit (``JobTable.reusable``)."""
        def wait_earlier(job: CheckpointJob) -> None:
            log.info("[datastates] rank %d: %s is saved again in this run; waiting for the earlier save to commit",
                     self.rank, checkpoint)
            self.wait_persisted(checkpoint, root=root)

        return self.jobs.reusable(root, checkpoint, wait_earlier)

    def _request_commit(self, job: CheckpointJob, on_committed: Callable[[Any], None] | None = None,
                        keep_last: int | None = None, retain: bool = False) -> None:
        if self.jobs.request_commit(job, on_committed, keep_last, retain) and self.replicas is not None:
            self.replicas.submit(job)  # every rank commits the same checkpoints in the same order

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
        _open_gates(pending)
        self.skips.await_snapshots(pending, started + timeout)
        self.failures.check()
        blocked = time.monotonic() - started
        self.blocked_total_s += blocked
        self.wait_total_s += blocked
        for job in {f.job for f in pending}:
            job.add_blocked(started, blocked)
        self._files = [f for f in self._files if not f.snapshot_done.is_set()]
        return blocked

    def wait_persisted(self, checkpoint: str | None = None, *, root: str | None = None,
                       timeout: float | None = None) -> None:
        """Block until saved files are durable on every level (peer replicas included) and commits are done."""
        deadline = time.monotonic() + (self.config.persist_timeout_s if timeout is None else timeout)
        _open_gates(self._files)
        if checkpoint is not None:
            key = (self._root(root), checkpoint)
            if key not in self.jobs.open:
                raise CheckpointError(f"checkpoint {checkpoint} has nothing pending on rank {self.rank} "
                                      "(never saved here, or already waited for)")
            jobs = [self.jobs.open[key]]
        else:
            jobs = self.jobs.jobs()
        for job in jobs:
            job.wait_settled(deadline, self.failures.check)
        if self.replicas is not None:
            self.replicas.wait(deadline)
        self.failures.check()
        self.jobs.forget_finished()

    # ------------------------------------------------------------------ loading
    def latest(self, root: str | None = None) -> str | None:
        """Id of the newest committed checkpoint under ``root``, or None."""
        committed = list_committed(self._root(root))
        return committed[-1][0] if committed else None

    def load(self, checkpoint: str, name: str | None = None, *, root: str | None = None,
             map_location: Any = None, allow_pickle: bool = False, verify: bool = True,
             level: str = "auto") -> Any:
        """Load one saved state of a committed checkpoint, from the node-local level when complete there."""
        return self._reader(checkpoint, name, root, verify, level).state(map_location, allow_pickle)

    def load_into(self, checkpoint: str, template: Any, name: str | None = None, *, root: str | None = None,
                  allow_pickle: bool = False, verify: bool = True, level: str = "auto") -> Any:
        """Like ``load``, but the tensors are read into those of ``template`` (a state of the same structure,
        e.g. the live model's), through the host cache: no new tensor memory to fault in."""
        return self._reader(checkpoint, name, root, verify, level).state_into(template, allow_pickle)

    def _reader(self, checkpoint: str, name: str | None, root: str | None, verify: bool, level: str):
        _require_checkpoint(checkpoint, self._root(root))
        committed = self.open_checkpoint(checkpoint, root=root, verify=verify)
        reader = committed.reader(f"rank{self.rank:05d}" if name is None else name, level)
        self.last_load_level = reader.level
        return reader

    def open_checkpoint(self, checkpoint: str, *, root: str | None = None, verify: bool = True) -> "CommittedCheckpoint":
        """A committed checkpoint's manifest plus per-file readers, for adapters that read selectively.

        With ``peer_replica`` this is a collective: ranks whose node-local copy is gone fetch
        their files from the peer holding their replica (``replica.py``).
        """
        _require_checkpoint(checkpoint, self._root(root))
        options = ReadOptions.from_config(self.config, verify=verify, rank=self.rank, staging=self.cache,
                                          classes=self.classes, peers=self.replicas)
        return open_committed(self._root(root), checkpoint, options)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float | None = None, *, normal_end: bool = True,
                 gate_collectives: bool = False) -> None:
        """Commit whatever was saved, wait until it is durable and committed, stop the threads.

        ``normal_end=False`` (interpreter exit, an exception) keeps the peer replicas this rank
        holds in host memory for a restart; a normal end frees them. Copies still held by a shut
        ``CopyGate`` then go ahead if the gate says its values are final (``ready``), or, with
        ``gate_collectives`` (the exit hook, after no uncaught exception: every rank exits alike),
        once the gate's settle ran its collective; otherwise they fail and their checkpoint with them.
        """
        if self._closed:
            return
        self._closed = True
        self._plans.clear()  # the views they keep hold the caller's memory
        if not normal_end:
            for fjob in self._files:
                if fjob.gate is not None and not fjob.snapshot_done.is_set():
                    done = fjob.gate.finish(gate_collectives)
                    log.log(logging.WARNING if done == "cancelled" else logging.INFO,
                            "[datastates] rank %d: %s's copies held for %s at the end: %s", self.rank,
                            fjob.job.checkpoint, fjob.gate.what, _GATE_AT_END[done])
        timeout = self.config.persist_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout  # the wait and the threads' stop together
        clean = False
        try:
            if self.failures.error is None:
                for job in self.jobs.jobs():
                    self._request_commit(job)
                self.committer.poke()
                self.wait_persisted(timeout=timeout)
                clean = normal_end
        finally:
            self.pipeline.stop(clean, deadline)
            try:
                self.cache.close()  # raises if CUDA refused to unpin it: reported, after the rest is released
            finally:
                self.ownership.release()
                _live_engines.discard(self)
        self.failures.check()

    def abandon(self, reason: str) -> dict:
        """Stop at once, committing nothing more: the job's process groups and commit store are gone
        (an in-process restart). Every open checkpoint fails on this rank (and, where the store still
        answers, on the others); the threads and the I/O worker end, the directory locks are
        released, so a new engine in this process starts clean. The host cache is freed only once
        no stage thread can still touch it; otherwise it is left to the garbage collector. Returns
        what was abandoned, for the caller's log."""
        if self._closed:
            return {"open": [], "running": [], "cache_freed": False}
        self._closed = True
        self._plans.clear()
        open_checkpoints = sorted(job.checkpoint for job in self.jobs.jobs() if not job.settled.is_set())
        for fjob in self._files:  # copies still held behind a gate never start: their tensors are the old attempt's
            if fjob.gate is not None and not fjob.snapshot_done.is_set():
                fjob.gate.cancel(f"abandoned: {reason}")
        try:
            self.failures.fail(CheckpointError(f"abandoned: {reason}"))
        except Exception as exc:  # the old store may be gone: the others then time out, naming this rank
            log.warning("[datastates] rank %d: abandoning the engine: %s", self.rank, exc)
        self.pipeline.stop(False)
        running = self.pipeline.running()
        try:
            if not running:
                self.cache.close()
        finally:
            self.ownership.release()
            _live_engines.discard(self)
        return {"open": open_checkpoints, "running": running, "cache_freed": not running}

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
        return resolve_root(root)

    def _writable_root(self, root: str | None) -> str:
        """The root a save or commit goes to; on rank 0 the job's lock on it (taken at first use)."""
        if self.read_only:
            raise CheckpointError("this engine was opened read_only: it loads, it does not save")
        root = self._root(root)
        self.ownership.lock_root(root)
        return root

    @property
    def local_lock(self):
        """This node's ``local_dir`` lock (None without a node-local level)."""
        return self.ownership.local_lock

    # Overload counts (save/overload.py), for benchmarks and tests.
    @property
    def backpressure_waits(self) -> int:
        """Calls of ``wait_snapshot`` that waited for the flush to free cache space."""
        return self.skips.backpressure_waits

    @property
    def backpressure_wait_s(self) -> float:
        return self.skips.backpressure_wait_s

    @property
    def age_bound_waits(self) -> int:
        """Saves the durable-age bound turned from "supersede" to "wait"."""
        return self.skips.age_bound_waits

    @property
    def newest_durable_version(self) -> int | None:
        """Version of the newest checkpoint committed in this run (what ``max_durable_age`` measures from)."""
        return self.committer.newest_committed

    def raise_if_failed(self) -> None:
        """Raise, on the caller's thread, the first failure of a background thread (cheap)."""
        self.failures.check()


def _open_gates(files: list[FileJob]) -> None:
    """On the training thread, before waiting for copies: settle every gate still shut, in save order."""
    for fjob in files:
        if fjob.gate is not None and not fjob.snapshot_done.is_set():
            fjob.gate.settle_and_open()


def _require_checkpoint(checkpoint: Any, root: str) -> None:
    """A load names a checkpoint; ``latest()`` is None before the first commit, and says so here."""
    if checkpoint is None:
        raise CheckpointError(f"no checkpoint to load: none is committed under {root} yet (engine.latest() returned "
                              "None). Resume only when there is one: `latest = engine.latest(); if latest is not "
                              "None: state = engine.load(latest)`")
    if not isinstance(checkpoint, str):
        raise CheckpointError(f"checkpoint must be a checkpoint id (a directory name under {root}), "
                              f"not {type(checkpoint).__name__}")


_GATE_AT_END = {"open": "opened already", "ready": "final already, copied",
                "settled": "settled here (its collective ran), copied", "cancelled": "cancelled, not committed"}


def _ended_on_exception() -> bool:
    """Whether the interpreter exits because of an uncaught exception (set before the exit hooks run)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _shutdown_live_engines() -> None:
    """At interpreter exit: the last checkpoint of a run is committed even if nobody waited.

    A save whose copies wait for a collective (``CopyGate``) is settled here when the interpreter
    ends without an uncaught exception: every rank of a job that exits normally reaches this hook
    and settles its gates in save order, as its last wait would have. After an uncaught exception
    only gates whose values are final already go ahead; the others fail (no collective).
    """
    collectives_ok = not _ended_on_exception()
    for engine in list(_live_engines):
        try:
            engine.shutdown(normal_end=False, gate_collectives=collectives_ok)
        except Exception:
            traceback.print_exc()


atexit.register(_shutdown_live_engines)

__all__ = ["CheckpointEngine"]
