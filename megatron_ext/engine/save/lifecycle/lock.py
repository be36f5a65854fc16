"""One writing job per directory: an ``flock``ed lock file that names its holder.

Two jobs saving into one directory (a requeued job and its accidental twin, two experiments
given the same path) would each commit checkpoints and delete the other's files. So a job locks
each directory it writes, for its whole life, with ``flock`` on ``<dir>/.datastates.lock``; the
file says who holds it (host, pid, run id, since when) so a refused job can name the holder.

* **One lock per job, not per rank.** All ranks of a job write into the same ``save_dir``: rank 0
  takes its lock before any rank writes (the run id is agreed with the outcome). A node-local
  directory is shared by the ranks of one node: each rank tries its lock, and a rank that finds it
  held by its own run (a sibling on the same node) goes on without holding it.
* **Stale locks.** ``flock`` belongs to the open file, so the kernel (or, on Lustre and GPFS, the
  lock server when it evicts a dead client) releases it when the holder dies: the next job takes
  the lock over and logs whose it was. Nothing is inferred from pids or ages.
* **Who may delete.** Only a job that holds a directory's lock removes anything there (retention,
  crashed partial checkpoints, leftovers of earlier runs), and retention removes only checkpoints
  whose run once held the lock (the file keeps the last runs' ids): never another job's, never
  a copy brought in from elsewhere.
* **Forked children.** A child forked while a lock is held (DataLoader workers, for instance)
  would share the open file and keep the flock after the engine released it, so the next engine
  of the same process (Megatron-LM shuts the engine down after training and saves once more)
  would find its own directory locked. Children close their copies right after the fork.
* **File systems without ``flock``** (Lustre mounted ``noflock``, some NFS): the lock cannot be
  taken; the engine warns once and writes, but removes nothing in that directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
import weakref

from ...errors import CheckpointError

LOCK_FILE = ".datastates.lock"
#: Runs remembered as former holders (retention may remove their checkpoints).
HISTORY = 1000
#: How long a rank waits for a sibling that just took the lock to write its name into it.
_HOLDER_WAIT_S = 10.0
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

log = logging.getLogger("megatron_ext.engine")


class LockedError(CheckpointError):
    """Another job holds the directory's lock."""


class DirectoryLock:
    """The lock of one directory as this rank sees it: ``held`` (the flock is ours), ``shared``
    (held by another rank of our run), or ``unsupported`` (the file system has no ``flock``)."""

    def __init__(self, directory: str, fd: int | None, state: str, runs: list[str]):
        self.directory = directory
        self._fd = fd
        self.state = state
        self.runs = runs  # run ids that have held this directory, oldest first
        if fd is not None:
            _open_locks.add(self)

    def _forget_in_child(self) -> None:
        """In a forked child: drop this copy of the file (the parent keeps the lock), write nothing."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
            self.state = "released"

    @property
    def held(self) -> bool:
        return self.state == "held"

    @property
    def job_holds(self) -> bool:
        """Whether this rank's job holds the lock (this rank or a sibling of the same run)."""
        return self.state in ("held", "shared")

    def release(self) -> None:
        """Say the directory is free (the next holder then takes no stale lock over), then unlock."""
        if self._fd is not None:
            try:
                data = json.dumps({"runs": self.runs, "released_at": time.time()}, indent=1).encode("utf-8")
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, data, 0)
            except OSError:
                pass  # the lock goes with the file all the same
            os.close(self._fd)  # closing the file releases the flock
            self._fd = None
            self.state = "released"


_open_locks: "weakref.WeakSet[DirectoryLock]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_open_locks):
        lock._forget_in_child()
    _open_locks.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def holder_text(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"run {holder.get('run_id', '?')} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"since {when})")


def acquire(directory: str, run_id: str, what: str, same_run_ok: bool = False) -> DirectoryLock:
    """Lock ``directory`` for run ``run_id`` (it must exist), or raise ``LockedError`` naming the holder.

    With ``same_run_ok`` a lock held by another process of the same run is accepted (node-local
    directories shared by the ranks of one node).
    """
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
    problem = _foreign(os.fstat(fd))
    if problem:  # nothing written: the file it links to, or another user's, stays as it is
        os.close(fd)
        raise CheckpointError(f"{path}: {problem}; refusing to use it as this job's lock (remove it if no job "
                              "runs here)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            os.close(fd)
            log.warning("[datastates] %s %s: the file system does not support flock (%s); one writer per directory "
                        "is not enforced there and nothing will be removed from it (no retention, no clean-up)",
                        what, directory, exc.strerror)
            return DirectoryLock(directory, None, "unsupported", [])
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            raise CheckpointError(f"cannot lock {path}: {exc.strerror or exc}") from None
        return _held_elsewhere(fd, path, directory, run_id, what, same_run_ok)
    try:
        previous = _read(fd)
        if previous.get("pid") is not None and previous.get("run_id") != run_id:
            log.warning("[datastates] %s %s: took over the lock of %s, which no longer holds it (the process ended)",
                        what, directory, holder_text(previous))
        runs = [r for r in previous.get("runs", []) if isinstance(r, str) and r != run_id][-(HISTORY - 1):] + [run_id]
        record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id, "since": time.time(),
                  "runs": runs}
        data = json.dumps(record, indent=1).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        raise CheckpointError(f"cannot write the lock file {path}: {exc.strerror or exc}") from None
    return DirectoryLock(directory, fd, "held", runs)


def _held_elsewhere(fd: int, path: str, directory: str, run_id: str, what: str, same_run_ok: bool) -> DirectoryLock:
    """The flock is taken: ours (a sibling rank of this run) or another job's.

    A holder writes its name right after it takes the lock, so for a moment the file may still
    name the previous holder: a sibling waits (bounded) until its own run id shows up, and the
    name in a refusal is read again after a short pause.
    """
    try:
        deadline = time.monotonic() + (_HOLDER_WAIT_S if same_run_ok else 0.3)
        holder = _read(fd)
        while not (same_run_ok and holder.get("run_id") == run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
            holder = _read(fd)
    finally:
        os.close(fd)
    if same_run_ok and holder.get("run_id") == run_id:
        return DirectoryLock(directory, None, "shared", list(holder.get("runs", [])))
    raise LockedError(
        f"{what} {directory} is in use by another job: {holder_text(holder)} holds {path}. One job writes a "
        "directory at a time: give this job another directory, or stop that one (its lock is released when it ends)")


def _foreign(st: os.stat_result) -> str | None:
    """Why an opened lock file is not ours to write, or None: the holder truncates and rewrites it,
    so a second hard link (to a file elsewhere) or another owner would have us overwrite a file
    that is not the lock (a symbolic link is refused by ``O_NOFOLLOW`` already)."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} links (a hard link to a file elsewhere?)"
    if st.st_uid != os.geteuid():
        return f"owned by user {st.st_uid}, not by this user ({os.geteuid()})"
    return None


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 1 << 20, 0)
        record = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def runs_of(directory: str) -> list[str]:
    """Run ids that have held ``directory``'s lock, read from the lock file (empty if none)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        runs = [] if _foreign(os.fstat(fd)) else _read(fd).get("runs", [])
    finally:
        os.close(fd)
    return [r for r in runs if isinstance(r, str)] if isinstance(runs, list) else []
