"""Retention: keep the last K committed checkpoints plus every M-th, delete the rest in the background.

Deletion never races a loader or a writer:

* only committed checkpoints (with a manifest) are candidates, never the newest one, never one
  this engine still has in flight;
* a checkpoint is first renamed to a hidden ``.<name>.deleting`` directory (one atomic rename,
  after which no loader sees it), then removed;
* the same decision is applied to this rank's node-local level, where each rank removes its own
  copies (rank 0 cannot reach other nodes' disks).

Partial checkpoints left by a crash (directories with our ``.reports`` but no manifest) are
removed at start-up by rank 0, before this run writes anything.
"""

from __future__ import annotations

import logging
import os
import shutil

from .commit import MANIFEST, REPORTS
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


def hide_and_remove(directory: str) -> None:
    """Atomically take a checkpoint out of sight, then delete it."""
    if not os.path.isdir(directory):
        return
    parent, name = os.path.split(directory.rstrip("/"))
    hidden = os.path.join(parent, f".{name}.deleting")
    shutil.rmtree(hidden, ignore_errors=True)
    try:
        os.replace(directory, hidden)
    except FileNotFoundError:  # another rank of this node removed the shared local copy first
        return
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
        if os.path.isdir(os.path.join(path, REPORTS)) and not os.path.exists(os.path.join(path, MANIFEST)):
            hide_and_remove(path)
            removed.append(name)
    return removed


class Deleter(QueueWorker):
    """One background thread that removes directories, so commits never wait for ``rmtree``."""

    def __init__(self):
        self.start("datastates-retention")

    def handle(self, directory: str) -> None:
        try:
            hide_and_remove(directory)
            log.info("[datastates] retention removed %s", directory)
        except OSError as exc:  # a failed deletion loses nothing; report it, keep training
            log.warning("[datastates] retention could not remove %s: %s", directory, exc)
