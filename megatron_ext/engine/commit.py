"""The commit protocol: the one place that decides when a checkpoint exists.

1. Each rank, once every file it saved under a checkpoint is durable on the shared level and the
   caller asked to commit, writes its *rank report* ``<ckpt>/.reports/rank-RRRRR.<run>.json``
   atomically (temp file, fsync, rename, directory fsync). With a node-local level, the same report
   also goes to the local directory, recording that the local copy is complete.
2. Rank 0 waits for the reports of all ranks of *this run*, merges them, and writes
   ``<ckpt>/manifest.json`` atomically. The manifest is the commit marker: a directory without
   one is not a checkpoint and is never loaded. Callbacks (a framework's "latest" tracker) run
   only after it is durable.
3. The other ranks learn of the commit by seeing the manifest of their run appear.

A failure on any rank writes ``rank-RRRRR.<run>.error.json``; every waiter polls for those and
fails with the first one's message instead of waiting out its timeout. A rank that skips a
checkpoint under ``overload_policy="supersede"`` writes ``rank-RRRRR.<run>.skipped.json`` instead
of its report (never both): every waiter then abandons that checkpoint, which is never committed,
and the run goes on. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Callable

from .files import atomic_write_json
from .jobs import CheckpointError, CheckpointJob, CheckpointSkipped, LEVEL_HOST, LEVEL_LOCAL, LEVEL_SHARED
from .manifest import (FORMAT_NAME, FORMAT_VERSION, MANIFEST, REPORTS, build_manifest, list_committed,  # noqa: F401
                       read_manifest, report_name, summarize_report)  # (re-exported)
from .telemetry import Telemetry

_POLL_S = 0.02


def skip_report_name(rank: int, run_id: str) -> str:
    return f"rank-{rank:05d}.{run_id}.skipped.json"


def _error_reports(reports_dir: str, run_id: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(reports_dir) if n.endswith(f".{run_id}.error.json"))
    except FileNotFoundError:
        return []


def _raise_peer_error(reports_dir: str, run_id: str, checkpoint: str) -> None:
    errors = _error_reports(reports_dir, run_id)
    if errors:
        try:
            with open(os.path.join(reports_dir, errors[0]), encoding="utf-8") as f:
                detail = json.load(f)
        except (OSError, ValueError):
            detail = {"rank": errors[0], "error": "unreadable error report"}
        raise CheckpointError(
            f"checkpoint {checkpoint} failed on rank {detail.get('rank')}: {detail.get('error')}")


def read_skip_report(reports_dir: str, run_id: str) -> dict | None:
    """The first skip report of ``run_id`` in a checkpoint's reports directory, or None."""
    try:
        skips = sorted(n for n in os.listdir(reports_dir) if n.endswith(f".{run_id}.skipped.json"))
    except FileNotFoundError:
        return None
    if not skips:
        return None
    try:
        with open(os.path.join(reports_dir, skips[0]), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"rank": skips[0], "reason": "unreadable skip report"}


def _raise_peer_skip(reports_dir: str, run_id: str, checkpoint: str) -> None:
    detail = read_skip_report(reports_dir, run_id)
    if detail is not None:
        raise CheckpointSkipped(f"checkpoint {checkpoint} skipped by rank {detail.get('rank')}: "
                                f"{detail.get('reason')}", detail)


class Committer:
    """Background thread: rank reports, and on rank 0 the manifest; in the order checkpoints get ready."""

    def __init__(self, rank: int, world_size: int, run_id: str, local_root: Callable[[CheckpointJob], str | None],
                 telemetry: Telemetry, timeout_s: float, fail: Callable[..., bool],
                 check: Callable[[], None], state_lock: threading.Lock | None = None,
                 abandon: Callable[[CheckpointJob, CheckpointSkipped], None] = lambda job, exc: None, *,
                 may_remove: Callable[[str], bool] = lambda root: False):
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.local_root = local_root
        self.telemetry = telemetry
        self.timeout_s = timeout_s
        self.fail = fail
        self.check = check
        self.state_lock = state_lock or threading.Lock()  # shared with whoever skips checkpoints
        self.abandon = abandon  # a peer skipped the checkpoint: drop it here too
        self.may_remove = may_remove  # whether this rank holds the lock of a root (lock.py)
        self._cond = threading.Condition()
        self._pending: list[CheckpointJob] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="datastates-committer", daemon=True)
        self._thread.start()

    def track(self, job: CheckpointJob) -> None:
        with self._cond:
            self._pending.append(job)

    def poke(self) -> None:
        """Something changed (a file became durable, a commit was requested): look again."""
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _next_ready(self) -> CheckpointJob | None:
        with self._cond:
            while True:
                for job in list(self._pending):
                    if job.abandoned:  # failed (and the engine survives) or skipped under overload
                        self._pending.remove(job)
                        job.committed.set()
                        continue
                    if job.commit_requested and job.durable_on(LEVEL_SHARED):
                        self._pending.remove(job)
                        return job
                if self._stopping and not any(j.commit_requested for j in self._pending):
                    return None
                try:
                    self.check()
                except CheckpointError:  # the engine stopped: nothing pending will become durable
                    for job in self._pending:
                        job.committed.set()
                    self._pending.clear()
                    return None
                self._cond.wait(0.5)

    def _run(self) -> None:
        while True:
            job = self._next_ready()
            if job is None:
                return
            try:
                self._commit(job)
            except CheckpointSkipped as exc:
                self.abandon(job, exc)
                job.committed.set()
            except BaseException as exc:
                fatal = self.fail(exc, job)
                job.committed.set()  # waiters wake up and see the error
                if fatal:
                    return

    def _commit(self, job: CheckpointJob) -> None:
        ckpt_dir = os.path.join(job.root, job.checkpoint)
        reports_dir = os.path.join(ckpt_dir, REPORTS)
        with self.state_lock:
            if job.abandoned:  # skipped while it waited here: it will not be committed
                job.committed.set()
                return
            job.reported = True
        report = {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": job.tag,
            "rank": self.rank, "world_size": self.world_size, "checkpoint": job.checkpoint,
            "version": job.version, "files": [f.report() for f in job.files],
        }
        os.makedirs(reports_dir, exist_ok=True)
        atomic_write_json(os.path.join(reports_dir, report_name(self.rank, job.tag)), report)
        local = self.local_root(job)
        if local is not None:
            local_reports = os.path.join(local, job.checkpoint, REPORTS)
            os.makedirs(local_reports, exist_ok=True)
            atomic_write_json(os.path.join(local_reports, report_name(self.rank, job.tag)), report)
        self._emit_levels(job)
        if self.rank == 0:
            manifest = self._write_manifest(job, ckpt_dir, reports_dir)
        else:
            manifest = self._await_manifest(job, ckpt_dir, reports_dir)
        job.manifest = manifest
        job.committed_at = time.monotonic()
        for callback in job.on_committed:
            callback(manifest)
        first = min(f.submitted_at for f in job.files) if job.files else job.committed_at
        if self.rank == 0:
            total = sum(f["size"] + f["state_size"] for f in manifest["files"].values())
            self.telemetry.emit("commit", job.checkpoint, "all", total, job.committed_at - first,
                                world_size=self.world_size)
        job.committed.set()

    def _emit_levels(self, job: CheckpointJob) -> None:
        if not job.files:
            return
        first = min(f.submitted_at for f in job.files)
        snap = max(f.snapshot_at or first for f in job.files)
        self.telemetry.emit("snapshot", job.checkpoint, LEVEL_HOST, job.nbytes, snap - first,
                            blocked_s=job.blocked_s)
        for level in (LEVEL_LOCAL, LEVEL_SHARED):
            done = [f.durable_at[level] for f in job.files if level in f.durable_at]
            if len(done) == len(job.files):
                self.telemetry.emit("flush", job.checkpoint, level, job.nbytes, max(done) - first,
                                    blocked_s=job.blocked_s)

    def _wait(self, what: str, ready: Callable[[], bool], reports_dir: str, job: CheckpointJob,
              detail: Callable[[], str] = lambda: "") -> None:
        checkpoint = job.checkpoint
        deadline = time.monotonic() + self.timeout_s
        job.commit_waiting_for = lambda: f"{what}{detail()}"
        try:
            while not ready():
                _raise_peer_skip(reports_dir, job.tag, checkpoint)
                _raise_peer_error(reports_dir, self.run_id, checkpoint)
                self.check()
                if time.monotonic() > deadline:
                    raise CheckpointError(f"checkpoint {checkpoint}: {what} within {self.timeout_s:.0f}s{detail()}")
                time.sleep(_POLL_S)
        finally:
            job.commit_waiting_for = None

    def _write_manifest(self, job: CheckpointJob, ckpt_dir: str, reports_dir: str) -> dict:
        names = [report_name(r, job.tag) for r in range(self.world_size)]
        paths = [os.path.join(reports_dir, n) for n in names]

        def all_reported() -> bool:
            return all(os.path.exists(p) for p in paths)

        def missing() -> str:
            return " (missing ranks: " + ", ".join(str(r) for r, p in enumerate(paths) if not os.path.exists(p)) + ")"

        self._wait("not every rank reported its files durable", all_reported, reports_dir, job, missing)
        summaries = []
        for name, path in zip(names, paths):
            with open(path, "rb") as f:
                summaries.append(summarize_report(f.read(), f"{job.checkpoint}/{REPORTS}/{name}"))
        # a second save of this id in this run: attempt_of names the run it belongs to
        manifest = build_manifest(job.checkpoint, job.tag, job.version, self.world_size, summaries,
                                  attempt_of=self.run_id if job.tag != self.run_id else None)
        atomic_write_json(os.path.join(ckpt_dir, MANIFEST), manifest)
        if self.may_remove(job.root):
            _remove_other_runs(ckpt_dir, job.tag)
        return manifest

    def _await_manifest(self, job: CheckpointJob, ckpt_dir: str, reports_dir: str) -> dict:
        found: dict = {}

        def committed() -> bool:
            try:
                manifest = read_manifest(ckpt_dir)
            except CheckpointError:  # another run's or a damaged one: rank 0 replaces it with ours
                return False
            if manifest is not None and manifest["run_id"] == job.tag:
                found["m"] = manifest
                return True
            return False

        self._wait("rank 0 did not write the manifest", committed, reports_dir, job)
        return found["m"]


_RUN_FILE = re.compile(r"\.([0-9a-f]{12})\.(safetensors|state\.json)$")


def _remove_other_runs(ckpt_dir: str, run_id: str) -> None:
    """Delete data files an earlier, overwritten or crashed attempt at this checkpoint left behind.

    Only files named like ours (``<name>.<12 hex>.safetensors`` / ``.state.json``) of another run,
    and never one the manifest on disk, re-read just before deleting, names. Usually there are
    none, and then the manifest is not read again.
    """
    leftovers = [n for n in os.listdir(ckpt_dir) if (m := _RUN_FILE.search(n)) and m.group(1) != run_id]
    if not leftovers:
        return
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError:
        return  # not ours to judge: leave everything
    if manifest is None or manifest["run_id"] != run_id:
        return
    keep = {os.path.basename(f[k]) for f in manifest["files"].values() for k in ("tensor_file", "state_file")}
    for name in leftovers:
        if name not in keep:
            try:
                os.unlink(os.path.join(ckpt_dir, name))
            except OSError:
                pass
