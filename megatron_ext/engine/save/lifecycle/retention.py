"""Retention: keep the last K committed checkpoints plus every M-th, delete the rest in the background.

Deletion never races a loader or a writer, and never touches what is not this job's:

* only a job holding a directory's lock removes anything there (lock.py);
* only committed checkpoints (with a valid manifest) of runs that held the lock are candidates,
  never the newest one, never one this engine still has in flight; the manifest is read again
  right before the removal;
* a checkpoint is first renamed to a hidden ``.<name>.deleting`` directory (one atomic rename,
  after which no loader sees it), then removed;
* the same decision is applied to the node-local level, where the ranks of each node remove
  their node's copies (rank 0 cannot reach other nodes' disks).

Partial checkpoints left by a crash (directories with our ``.reports``, or only our data files,
but no manifest) are removed at start-up by rank 0, holding the lock, before this run writes
anything, and so are data files a committed checkpoint's manifest does not name (a later save of
the same id that crashed): on a file system such a crash filled, they are what the restart needs.
On each node the holder of the local level's lock does the same there, before any rank of the
node writes: copies of checkpoints with no manifest on the shared level, and half-removed ones.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import TYPE_CHECKING, Callable

from ... import faults
from ...errors import CheckpointError
from ...files import tree_bytes
from ...format.catalog import list_committed, manifest_exists, read_manifest, remember_committed, run_of
from ...object_store import is_object_url
from ...format.names import MANIFEST, REPORTS, RUN_FILE
from ..flow.worker import QueueWorker
from ..job.jobs import CheckpointJob
from ..job.table import JobTable
from . import object_root

if TYPE_CHECKING:
    from ..replicas.replica import PeerReplicas

log = logging.getLogger("megatron_ext.engine")


def to_delete(committed: list[tuple[str, int | None]], keep_last: int | None, keep_every: int | None,
              protected: set[str]) -> list[str]:
    """Names to delete from ``committed`` (oldest first, as ``list_committed`` returns them).

    The policy counts one series: the versioned checkpoints when there are any, and then an
    unversioned one beside them (a named export, ``final``) is never deleted; a job that saves
    no versions (DeepSpeed's tags) is counted by commit time.
    """
    if keep_last is None:
        return []
    if any(isinstance(version, int) for _, version in committed):
        committed = [(name, version) for name, version in committed if isinstance(version, int)]
    names = [name for name, _ in committed]
    keep = set(names[-keep_last:]) | set(names[-1:]) | protected
    if keep_every:
        keep |= {name for name, version in committed if isinstance(version, int) and version % keep_every == 0}
    return [name for name in names if name not in keep]


@dataclasses.dataclass(frozen=True)
class Removal:
    """A checkpoint directory to remove; ``run_id``: the run its manifest must still name (None: a
    node-local copy, which has no manifest)."""

    directory: str
    run_id: str | None


def still_ours(removal: Removal) -> bool:
    """Right before deleting: the manifest still names the run retention chose it for."""
    if removal.run_id is None:
        return True
    try:
        manifest = read_manifest(removal.directory)
    except CheckpointError:
        return False
    return manifest is not None and manifest["run_id"] == removal.run_id


def hide(directory: str) -> str | None:
    """Atomically take a checkpoint out of sight (``.<name>.deleting``); None if it is gone already."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        return None
    parent, name = os.path.split(directory.rstrip("/"))
    hidden = os.path.join(parent, f".{name}.deleting")
    shutil.rmtree(hidden, ignore_errors=True)
    try:
        os.replace(directory, hidden)
    except FileNotFoundError:  # another rank of this node removed the shared local copy first
        return None
    return hidden


def hide_and_remove(directory: str) -> None:
    """Atomically take a checkpoint out of sight, then delete it."""
    if is_object_url(directory):
        object_root.remove_checkpoint(directory)
        return
    hidden = hide(directory)
    if hidden is not None:
        faults.stop_point("mid_retention")
        shutil.rmtree(hidden, ignore_errors=True)


def _partial_of(path: str, runs: set[str]) -> bool:
    """An uncommitted save of this job: no manifest, and either our ``.reports`` or only data files
    named like ours, one of them of a run that held the lock (a crash can come before ``.reports``)."""
    if os.path.islink(path) or os.path.lexists(os.path.join(path, MANIFEST)):
        return False
    if os.path.isdir(os.path.join(path, REPORTS)):
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    tags = [m.group(1) for n in names if (m := RUN_FILE.search(n))]
    return bool(tags) and len(tags) == len(names) and any(tag in runs for tag in tags)


def remove_unlisted(ckpt_dir: str, run_id: str | None = None) -> int:
    """Delete data files named like ours (``<name>.<12 hex>.safetensors`` / ``.state.json``) that the
    committed manifest of ``ckpt_dir``, read just before, does not name: an earlier, overwritten or
    crashed attempt at this checkpoint. With ``run_id`` (rank 0 after writing its manifest) only
    other runs' files, and only under a manifest of that run. Returns the bytes freed; the
    manifest's files always stay, and usually there is nothing to remove and nothing is read."""
    if is_object_url(ckpt_dir):
        try:
            manifest = read_manifest(ckpt_dir)
        except CheckpointError:
            return 0
        if manifest is None or (run_id is not None and manifest["run_id"] != run_id):
            return 0
        return object_root.remove_unlisted(ckpt_dir, manifest, run_id=run_id)
    try:
        leftovers = [n for n in os.listdir(ckpt_dir) if (m := RUN_FILE.search(n)) and m.group(1) != run_id]
    except OSError:
        return 0
    if not leftovers:
        return 0
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError:
        return 0  # not ours to judge: leave everything
    if manifest is None or (run_id is not None and manifest["run_id"] != run_id):
        return 0
    keep = {os.path.basename(f[k]) for f in manifest["files"].values() for k in ("tensor_file", "state_file")}
    freed = 0
    for name in leftovers:
        if name not in keep:
            try:
                size = os.lstat(os.path.join(ckpt_dir, name)).st_size
                os.unlink(os.path.join(ckpt_dir, name))
                freed += size
            except OSError:
                pass
    return freed


def _remove_if_deleting(path: str) -> int:
    """A hidden entry of a level: removed if it is a checkpoint retention renamed away before a crash
    (``.<name>.deleting``); returns the bytes freed."""
    if not path.endswith(".deleting") or not os.path.isdir(path) or os.path.islink(path):
        return 0
    freed = tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return freed


def remove_partial(root: str, runs: set[str] = frozenset()) -> tuple[list[str], int]:
    """Delete what crashed saves of this job left under ``root``; returns the uncommitted
    checkpoints removed and the bytes freed (a committed checkpoint keeps its manifest's files).

    ``runs``: the runs that held ``root``'s lock; a directory without ``.reports`` counts only
    with files of one of them.
    """
    if is_object_url(root):
        return object_root.remove_partial(root, runs)
    return _sweep(root, runs, lambda name, path: os.path.lexists(os.path.join(path, MANIFEST)), remove_unlisted)


def remove_uncommitted_local(local_root: str, shared_root: str, runs: set[str]) -> tuple[list[str], int]:
    """On a node's local level: the same for this job's copies of checkpoints that have no manifest
    on the shared level (a crash before the commit, or after retention removed the shared one).

    The local level holds no manifest of its own: a checkpoint is committed when the shared level's
    manifest exists (one ``lstat`` per local checkpoint, once at start-up).
    """
    return _sweep(local_root, runs, lambda name, path: manifest_exists(os.path.join(shared_root, name)),
                  lambda path: 0)


def _sweep(root: str, runs: set[str], committed: Callable[[str, str], bool],
           tidy_committed: Callable[[str], int]) -> tuple[list[str], int]:
    """One level's start-up sweep: half-removed checkpoints, and this job's directories that
    ``committed(name, path)`` says never were; ``tidy_committed(path)`` for those that were."""
    removed, freed = [], 0
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed, freed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith("."):
            freed += _remove_if_deleting(path)
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if committed(name, path):
            freed += tidy_committed(path)
            continue
        if not _partial_of(path, runs):
            continue
        hidden = hide(path)
        if hidden is None:
            continue
        if committed(name, hidden):  # committed after all, just now: keep it
            os.replace(hidden, path)
            continue
        freed += tree_bytes(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(name)
    return removed, freed


class Deleter(QueueWorker):
    """One background thread that removes directories, so commits never wait for ``rmtree``."""

    def __init__(self):
        self.start("datastates-retention")

    def handle(self, removal: Removal) -> None:
        directory = removal.directory
        if not still_ours(removal):
            log.warning("[datastates] retention left %s alone: its manifest changed since it was chosen", directory)
            return
        try:
            hide_and_remove(directory)
            log.info("[datastates] retention removed %s", directory)
        except OSError as exc:  # a failed deletion loses nothing; report it, keep training
            log.warning("[datastates] retention could not remove %s: %s", directory, exc)


class RetentionStage:
    """The last stage of the save pipeline: after each commit, remove what the keep policy no longer keeps.

    Only checkpoints of runs that held the root's lock count (never another job's, never a copy
    brought in from elsewhere), and only a holder of a directory's lock removes anything there;
    a rank that holds none lists nothing (no metadata load on the shared file system). The
    manifest just committed is remembered, not read back.
    """

    def __init__(self, config, ownership, jobs: JobTable, replicas: "PeerReplicas | None"):
        self.config = config
        self.ownership = ownership  # ownership.DirectoryOwnership
        self.jobs = jobs  # checkpoints still being saved here are never deleted
        self.replicas = replicas  # nor those still being replicated to the peer
        self.deleter: Deleter | None = None  # started by the first retention that deletes
        self._manifests_seen: dict[str, dict] = {}  # root -> list_committed's cache

    def committed(self, job: CheckpointJob, manifest: dict) -> None:
        """``job`` was just committed (``manifest``): apply the policy to its root."""
        root, ownership = job.root, self.ownership
        if not ownership.holds(root) and not ownership.holds_local:
            return
        runs = ownership.retention_runs(root)
        cache = self._manifests_seen.setdefault(root, {})
        remember_committed(cache, os.path.join(root, job.checkpoint), manifest)
        ours = [(name, m) for name, m in list_committed(root, cache) if run_of(m) in runs]
        owner = {name: m["run_id"] for name, m in ours}
        local = self.config.local_dir if ownership.holds_local else None
        own = job.request.keep_last  # this commit's own bound (the training thread's request), or None
        keep_every = self.config.keep_every if own is None else None
        keep_last = self.config.keep_last if own is None else own
        for name in to_delete([(n, m["version"]) for n, m in ours], keep_last, keep_every, self.in_flight(root)):
            if self.deleter is None:
                self.deleter = Deleter()
            if ownership.holds(root):
                self.deleter.submit(Removal(os.path.join(root, name), owner[name]))
            if local:
                self.deleter.submit(Removal(os.path.join(local, name), None))

    def in_flight(self, root: str) -> set[str]:
        """Checkpoints under ``root`` retention must leave alone: not committed yet, or still replicating."""
        pending = self.jobs.in_flight(root)
        if self.replicas is not None:
            pending |= self.replicas.pending()
        return pending

    def stop(self, timeout: float) -> None:
        if self.deleter is not None:
            self.deleter.stop(timeout)
