"""The catalog of committed checkpoints under a root: which exist (a validated manifest each),
in commit order, with a cache keyed by the manifest's identity so a scan does not re-read them."""

from __future__ import annotations

import logging
import os

from .. import object_store
from ..errors import CheckpointError
from ..object_store import is_object_url
from .names import MANIFEST
from .validation import MAX_MANIFEST_BYTES, parse_json, read_bounded, validate_manifest

log = logging.getLogger("megatron_ext.engine")


def read_manifest(checkpoint_dir: str) -> dict | None:
    """The validated manifest of a committed checkpoint, or None if the directory has none.

    A manifest that is unreadable, not ours, or fails validation raises ``CheckpointError``
    naming the file and the first problem.
    """
    path = os.path.join(checkpoint_dir, MANIFEST)
    raw = read_bounded(path, MAX_MANIFEST_BYTES, missing_ok=True)
    if raw is None:
        return None
    doc = parse_json(raw, path)
    return validate_manifest(doc, os.path.basename(os.path.normpath(checkpoint_dir)), path)


def run_of(manifest: dict) -> str:
    """The run that committed ``manifest``: its ``run_id``, or for a checkpoint that run saved again, ``attempt_of``.

    ``run_id`` names the attempt (its files, reports and headers carry it); a second save of the
    same checkpoint id in one run is an attempt of its own, tied to the run by ``attempt_of``.
    """
    return manifest.get("attempt_of") or manifest["run_id"]


def _identity(checkpoint_dir: str) -> tuple:
    if is_object_url(checkpoint_dir):  # an object's ETag changes with every write of it
        return object_store.identity(os.path.join(checkpoint_dir, MANIFEST))
    st = os.lstat(os.path.join(checkpoint_dir, MANIFEST))
    return st.st_ino, st.st_size, st.st_mtime_ns


def manifest_exists(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` has a manifest (committed, or being judged): one ``lstat`` or ``HEAD``."""
    path = os.path.join(checkpoint_dir, MANIFEST)
    return object_store.exists(path) if is_object_url(path) else os.path.lexists(path)


def entry_exists(path: str) -> bool:
    """Whether anything is at ``path``: a file or directory, or on the object-store level any object below it."""
    return object_store.has_objects(path) if is_object_url(path) else os.path.lexists(path)


def checkpoint_dirs(root: str) -> list[str]:
    """The names of the entries under ``root`` that may be checkpoints (not hidden; directories, or
    on the object-store level common prefixes); empty if ``root`` does not exist."""
    if is_object_url(root):
        return [name for name in object_store.list_children(root)[0] if not name.startswith(".")]
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [n for n in names if not n.startswith(".") and os.path.isdir(os.path.join(root, n))]


def remember_committed(cache: dict, checkpoint_dir: str, manifest: dict) -> None:
    """Put a manifest this process has just committed into a ``list_committed`` cache, so the next
    listing does not read and validate it again (at 4,096 ranks: 1.5 MB and ~20 ms per commit)."""
    try:
        cache[checkpoint_dir] = (_identity(checkpoint_dir), manifest)
    except OSError:
        pass  # gone already: the listing will say so


def list_committed(root: str, cache: dict | None = None) -> list[tuple[str, dict]]:
    """Committed checkpoints under ``root``, oldest first (``commit_order``).

    A directory whose manifest is unreadable, another tool's, or invalid is skipped with a
    warning: one bad directory never hides the others or blocks later commits. ``cache`` (a dict
    the caller keeps) remembers validated manifests by file identity, so a caller that lists the
    same root after every commit reads and validates each manifest once.
    """
    found = []
    for name in checkpoint_dirs(root):
        path = os.path.join(root, name)
        if cache is not None:
            try:
                key = _identity(path)
            except OSError:
                continue
            hit = cache.get(path)
            if hit is not None and hit[0] == key:
                if hit[1] is not None:
                    found.append((name, hit[1]))
                continue
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            log.warning("[datastates] skipping %s: %s", path, exc)
            manifest = None
        if cache is not None:
            cache[path] = (key, manifest)
        if manifest is not None:
            found.append((name, manifest))
    found.sort(key=lambda item: commit_order(item[1]))
    return found


def commit_order(manifest: dict) -> tuple:
    """Sort key, oldest first: by version, then commit time; an unversioned checkpoint (version
    null, e.g. a one-off ``save(state, "final_export")``) is older than every versioned one, so
    ``latest()`` and retention's "newest" are always the highest version when there is one."""
    version = manifest["version"]
    return (version is not None, version if version is not None else 0, manifest["committed_at"])
