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

Partial checkpoints left by a crash (directories with our ``.reports`` but no manifest) are
removed at start-up by rank 0, holding the lock, before this run writes anything.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

from .commit import REPORTS
from .jobs import CheckpointError
from .manifest import MANIFEST, read_manifest
from .worker import QueueWorker

log = logging.getLogger("megatron_ext.engine")


def to_delete(committed: list[tuple[str, int | None]], keep_last: int | None, keep_every: int | None,
              protected: set[str]) -> list[str]:
    """Names to delete from ``committed`` (oldest first, as ``list_committed`` returns them)."""
    if keep_last is None:
        return []
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
    hidden = hide(directory)
    if hidden is not None:
        shutil.rmtree(hidden, ignore_errors=True)


def remove_partial(root: str) -> list[str]:
    """Delete uncommitted checkpoint directories a crashed run left behind; returns their names."""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith("."):
            if name.endswith(".deleting"):
                shutil.rmtree(path, ignore_errors=True)
            continue
        if os.path.isdir(os.path.join(path, REPORTS)) and not os.path.lexists(os.path.join(path, MANIFEST)) \
                and not os.path.islink(path):
            hidden = hide(path)
            if hidden is None:
                continue
            if os.path.lexists(os.path.join(hidden, MANIFEST)):  # committed after all, just now: keep it
                os.replace(hidden, path)
                continue
            shutil.rmtree(hidden, ignore_errors=True)
            removed.append(name)
    return removed


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
