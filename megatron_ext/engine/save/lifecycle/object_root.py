"""The object-store level's lifecycle: the run record of a root, the start-up clean-up of a crash,
a checkpoint's removal. The file system's versions are lock.py and retention.py.

* **No lock, a record.** S3 has no ``flock``: nothing stops two jobs writing one prefix (docs/
  ARCHITECTURE.md, "The object-store level": one job per prefix is the user's to keep). The
  record object ``<root>/.datastates.lock`` keeps what retention needs, the runs that wrote here,
  and names the last writer, so a second job warns when it finds a writer that never released
  the root.
* **A crash leaves incomplete uploads and objects without a manifest.** At start-up rank 0 aborts
  every incomplete multipart upload under the root (the server keeps their parts until then) and
  deletes the objects of this job's uncommitted checkpoints, as on a file system.
* **Out of sight first.** A checkpoint is removed manifest first: one DELETE, after which no reader
  lists it; its other objects follow (a crash in between leaves objects the next start-up removes).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from ... import object_store
from ...errors import CheckpointError
from ...format.names import MANIFEST, REPORTS, RUN_FILE
from .lock import HISTORY, LOCK_FILE, holder_text

log = logging.getLogger("megatron_ext.engine")


def _read_record(root: str) -> dict:
    try:
        record = json.loads(object_store.get(os.path.join(root, LOCK_FILE), max_bytes=1 << 20).decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


class ObjectRootRecord:
    """A root's record as ``lock.DirectoryLock`` offers it: ``held`` (this job wrote the record),
    ``runs`` (the runs that wrote here, oldest first), ``release`` (says the root is free)."""

    def __init__(self, root: str, runs: list[str]):
        self.directory = root
        self.runs = runs
        self.state = "held"

    @property
    def held(self) -> bool:
        return self.state == "held"

    @property
    def job_holds(self) -> bool:
        return self.held

    def release(self) -> None:
        if self.state != "held":
            return
        self.state = "released"
        try:
            object_store.put(os.path.join(self.directory, LOCK_FILE),
                             json.dumps({"runs": self.runs, "released_at": time.time()}, indent=1).encode("utf-8"))
        except OSError as exc:
            log.warning("[datastates] could not mark %s released: %s", self.directory, exc)


def acquire(root: str, run_id: str, what: str) -> ObjectRootRecord:
    """Record run ``run_id`` as the writer of ``root``; warns when the record names a writer that
    never released it (another job writing now, or one that crashed)."""
    previous = _read_record(root)
    if previous.get("pid") is not None and previous.get("run_id") != run_id and "released_at" not in previous:
        log.warning("[datastates] %s %s: its record names %s as a writer that did not release it (a crash, or "
                    "another job writing this prefix now: an object store has no locks, so keep one job per prefix)",
                    what, root, holder_text(previous))
    runs = [r for r in previous.get("runs", []) if isinstance(r, str) and r != run_id][-(HISTORY - 1):] + [run_id]
    record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id, "since": time.time(), "runs": runs}
    try:
        object_store.put(os.path.join(root, LOCK_FILE), json.dumps(record, indent=1).encode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"cannot write the record {os.path.join(root, LOCK_FILE)}: {exc.strerror or exc}") from None
    return ObjectRootRecord(root, runs)


def runs_of(root: str) -> list[str]:
    runs = _read_record(root).get("runs", [])
    return [r for r in runs if isinstance(r, str)] if isinstance(runs, list) else []


def _uncommitted_of(names: list[str], runs: set[str]) -> bool:
    """Objects of a checkpoint with no manifest that this job wrote: our ``.reports``, or only data
    objects named like ours, one of them of a run of this job (a crash can come before ``.reports``)."""
    if any(n.startswith(REPORTS + "/") for n in names):
        return True
    tags = [m.group(1) for n in names if (m := RUN_FILE.search(n))]
    return bool(tags) and len(tags) == len(names) and any(tag in runs for tag in tags)


def remove_partial(root: str, runs: set[str]) -> tuple[list[str], int]:
    """At start-up (rank 0, before any rank writes): abort the incomplete uploads under ``root`` and
    delete this job's uncommitted checkpoints; returns the checkpoints removed and the bytes freed."""
    from ...format.catalog import read_manifest

    aborted = object_store.abort_incomplete_uploads(root)
    if aborted:
        log.warning("[datastates] aborted %d incomplete upload(s) under %s (a crash mid-flush)", aborted, root)
    removed, freed = [], 0
    for name in object_store.list_children(root)[0]:
        path = os.path.join(root, name)
        objects = list(object_store.walk(path))
        names = [n for n, _ in objects]
        if MANIFEST in names:
            try:
                manifest = read_manifest(path)
            except CheckpointError:
                continue  # not ours to judge
            if manifest is not None:
                freed += remove_unlisted(path, manifest, objects)
            continue
        if not _uncommitted_of(names, runs):
            continue
        object_store.delete([os.path.join(path, n) for n in names])
        freed += sum(size for _, size in objects)
        removed.append(name)
    return removed, freed


def remove_unlisted(ckpt: str, manifest: dict, objects: list[tuple[str, int]] | None = None,
                    run_id: str | None = None) -> int:
    """Delete data objects named like ours that ``manifest`` (committed, read just before) does not
    name: an earlier or crashed attempt at this checkpoint. With ``run_id``, only other runs'."""
    if objects is None:
        objects = list(object_store.walk(ckpt))
    inside = manifest["checkpoint"] + "/"  # the manifest names files from the root: "<checkpoint>/<file>"
    keep = {f[k].removeprefix(inside) for f in manifest["files"].values() for k in ("tensor_file", "state_file")}
    doomed = [(n, size) for n, size in objects
              if "/" not in n and (m := RUN_FILE.search(n)) and m.group(1) != run_id and n not in keep]
    object_store.delete([os.path.join(ckpt, n) for n, _ in doomed])
    return sum(size for _, size in doomed)


def remove_checkpoint(ckpt: str) -> None:
    """The manifest first (the checkpoint is out of every reader's sight), then everything else."""
    object_store.delete([os.path.join(ckpt, MANIFEST)])
    object_store.delete_tree(ckpt)


__all__ = ["ObjectRootRecord", "acquire", "runs_of", "remove_partial", "remove_unlisted", "remove_checkpoint"]
