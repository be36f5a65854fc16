"""Free space: a restart on a file system a crashed save filled, and what an ENOSPC says.

A save that fills the file system fails (the error reaches the training thread), and its partial
files stay behind. The restarted job must not be refused for the space they take: the start-up
probe of a full directory is deferred (``EngineConfig.validate(full_ok=True)``) until rank 0,
holding the lock, has removed what crashed saves left (``retention.remove_partial``), then made
again. Still full: the error says how much a save needs against what is free, since only the
user may remove committed checkpoints.
"""

from __future__ import annotations

import errno
import logging
import os

from ...config import EngineConfig
from ...errors import CheckpointError, ConfigError
from ...format.catalog import list_committed

log = logging.getLogger("megatron_ext.engine")

#: The errors that mean "no room", not "not writable": a file system or a quota full.
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(nbytes: int | None) -> str:
    if nbytes is None:
        return "an unknown number of bytes"
    return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


def newest_committed_bytes(save_dir: str, rank: int | None = None) -> tuple[str, int] | None:
    """The newest committed checkpoint under ``save_dir`` and its bytes (of ``rank``'s files only,
    when given): what the next save of the same job will need, about."""
    try:
        committed = list_committed(save_dir)
    except (OSError, CheckpointError):
        return None
    if not committed:
        return None
    name, manifest = committed[-1]
    files = [f for f in manifest["files"].values() if rank is None or f.get("rank") == rank]
    return name, sum(int(f["size"]) + int(f["state_size"]) for f in files)


def _need_text(config: EngineConfig, what: str, rank: int) -> tuple[int | None, str]:
    """How much one save needs in ``what`` (``save_dir``: the whole checkpoint; ``local_dir``: this rank's part)."""
    if config.save_dir is None:
        return None, "no checkpoint is committed yet to say how much a save needs"
    newest = newest_committed_bytes(config.save_dir, None if what == "save_dir" else rank)
    if newest is None:
        return None, "no checkpoint is committed yet to say how much a save needs"
    name, need = newest
    whose = "" if what == "save_dir" else f" (rank {rank}'s files)"
    return need, f"the newest committed checkpoint, {name}, takes {size_text(need)}{whose}: a save needs about as much"


def recheck_full(config: EngineConfig, full: list[tuple[str, str]], rank: int, freed: int) -> None:
    """After the start-up clean-up: probe again the directories found full; still full is a
    ``ConfigError`` with the bytes a save needs against those free, nearly full a warning (once
    per file system: the telemetry directory is usually on save_dir's)."""
    still = {path for _, path in config.validate(rank, full_ok=True)}
    cleaned = (f"removing the uncommitted saves crashed runs left freed {size_text(freed)}" if freed else
               "no uncommitted save of this job was left to remove")
    seen: set[int] = set()
    for what, path in full:
        free = free_bytes(path)
        need, need_text = _need_text(config, what, rank)
        if path in still:
            raise ConfigError(
                f"{what} {path!r} is full: {size_text(free)} free ({cleaned}); {need_text}. Committed checkpoints "
                f"are never removed to make room: remove old ones (or keep fewer, keep_last) or give {what} more "
                "space, then restart")
        try:
            device = os.stat(path).st_dev
        except OSError:
            device = -1
        if device in seen:
            continue
        seen.add(device)
        if need is not None and free is not None and free < need:
            log.warning("[datastates] %s %s was full at start-up; %s, %s free now; %s, so the next save fails for "
                        "want of %s unless space is freed", what, path, cleaned, size_text(free), need_text,
                        size_text(need - free))
        else:
            log.warning("[datastates] %s %s was full at start-up; %s, %s free now", what, path, cleaned,
                        size_text(free))


def shortfall_note(exc: BaseException, root: str, nbytes: int) -> str:
    """For a failure that is a full file system: what the checkpoint needs against what is free."""
    if not isinstance(exc, OSError) or exc.errno not in FULL:
        return ""
    return (f" (the checkpoint needs {size_text(nbytes)} on this rank; {root} has {size_text(free_bytes(root))} "
            "free with its partial files, which the next start removes)")


__all__ = ["FULL", "free_bytes", "newest_committed_bytes", "recheck_full", "shortfall_note", "size_text"]
