"""Reading from the object-store level: a file's objects fetched by ranged GETs in parallel into a
private scratch directory, then read there like any file (``FileReader``, its checksums included).

The scratch lies under the node-local level when one is configured (fast local disk), else under
the system's temporary directory; it lives as long as the reader that uses it. Fetching whole
files first keeps one read path for every level (region reads, ``read_into``, staging, checks).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from .. import object_store
from ..errors import CheckpointError
from ..format.entries import FileEntry


def fetch(root: str, checkpoint: str, file: FileEntry, scratch: str | None, sidecar: bool = True) -> str:
    """``file``'s tensor file and (``sidecar``) its sidecar from ``root`` (an object-store URL) into a
    new private directory laid out as the checkpoint root is; returns it (``release_with`` removes it)."""
    if scratch:
        os.makedirs(scratch, exist_ok=True)
    base = tempfile.mkdtemp(prefix=".datastates-fetch-", dir=scratch or None)
    try:
        wanted = [(file.tensor_file, file.size)] + ([(file.state_file, file.state_size)] if sidecar else [])
        for relative, size in wanted:
            url = object_store.join(root, relative)
            try:
                found = object_store.size(url)
            except FileNotFoundError:
                raise CheckpointError(f"{url}: missing (checkpoint {checkpoint} lists it)") from None
            if found != size:
                raise CheckpointError(f"{url}: has {found} bytes, the manifest says {size}")
            target = os.path.join(base, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                object_store.download(url, fd, size)
            except OSError as exc:
                raise CheckpointError(f"{url}: cannot be read: {exc.strerror or exc}") from None
            finally:
                os.close(fd)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    return base


def release_with(owner: object, base: str) -> None:
    """Remove ``base`` once ``owner`` (the reader using it) is gone, or at exit."""
    weakref.finalize(owner, shutil.rmtree, base, True)


__all__ = ["fetch", "release_with"]
