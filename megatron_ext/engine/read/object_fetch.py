"""Reading from the object-store level: a file's objects fetched by ranged GETs in parallel into a
private scratch directory, then read there like any file (``FileReader``, its checksums included).

The scratch lies under the node-local level when one is configured (fast local disk), else under
the system's temporary directory; it lives as long as the reader that uses it. Fetching whole
files first keeps one read path for every level (region reads, ``read_into``, staging, checks).
A process killed while it read leaves its scratch behind (a rank's files: gigabytes of the node's
disk): each scratch is named by the process that made it (pid and start time), and the first
fetch of a process into a directory removes the ones whose process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import threading
import weakref

from .. import object_store
from ..errors import CheckpointError
from ..format.entries import FileEntry


PREFIX = ".datastates-fetch-"
_NAMED = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-")
_swept: set[str] = set()  # the directories this process has swept
_sweep_lock = threading.Lock()


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field); None if
    there is no such process (or no /proc to ask)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except OSError:
        return None
    return int(line[line.rindex(b")") + 2:].split()[19])  # fields after the command name, which may hold spaces


def _owner_tag() -> str:
    pid = os.getpid()
    return f"{pid}-{_started(pid) or 0}-"


def sweep_stale(directory: str) -> list[str]:
    """Remove the scratch directories under ``directory`` whose process is gone (a pid now running
    another process counts as gone: its start time differs); returns their names."""
    if not os.path.isdir("/proc/self"):
        return []
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        match = _NAMED.match(name)
        if match is None:
            continue
        pid, started = int(match.group(1)), int(match.group(2))
        if _started(pid) == started:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # ours only, never through a link
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def _sweep_once(directory: str) -> None:
    with _sweep_lock:
        if directory in _swept:
            return
        _swept.add(directory)
    sweep_stale(directory)


def fetch(root: str, checkpoint: str, file: FileEntry, scratch: str | None, sidecar: bool = True) -> str:
    """``file``'s tensor file and (``sidecar``) its sidecar from ``root`` (an object-store URL) into a
    new private directory laid out as the checkpoint root is; returns it (``release_with`` removes it)."""
    if scratch:
        os.makedirs(scratch, exist_ok=True)
    parent = scratch or tempfile.gettempdir()
    _sweep_once(os.path.abspath(parent))
    base = tempfile.mkdtemp(prefix=PREFIX + _owner_tag(), dir=parent)
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


__all__ = ["fetch", "release_with", "sweep_stale"]
