"""How ranks agree on a commit: statuses in, one decision out, over a key-value store.

Polling the shared file system for other ranks' reports costs every rank metadata operations
all the time a commit is pending (with a checkpoint every iteration: always), which a Lustre or
GPFS metadata server shared by a whole cluster feels at hundreds of ranks. So only the durable
record goes to the file system (each rank's report, rank 0's manifest: O(1) files per rank);
who is done, who skipped or failed, and what rank 0 decided travel through a
``torch.distributed`` store (the job's TCPStore, the one ``init_process_group`` rendezvoused
on), whose ``wait`` blocks on the server without polling.

Per checkpoint attempt, under ``<root digest>/<checkpoint>/<tag>/``:

* ``statuses``: every rank appends exactly one line (``durable``, ``skipped`` or ``failed``) and
  increments ``count``; the rank whose increment reaches the world size sets ``all``. Per rank:
  three store operations, whatever the world size.
* ``decision``: rank 0 waits for ``all``, reads the lines in one ``get``, decides (``committed``,
  ``skipped``, ``failed``) and sets it; first writer wins (``compare_set``), so a rank 0 that
  fails while others wait settles its open checkpoints at once. The other ranks wait for it.
* ``skip``: the first rank that skips the checkpoint leaves its reason here, so the others can
  drop their copy before the decision (``peer_skip``, one ``check``).

Every rank processes its checkpoints in the order it asked to commit them, the same on every rank
(training is SPMD), so when rank 0 has every status of a later checkpoint, no rank reads an older
one's keys any more and rank 0 deletes them: the store holds O(1) checkpoints' keys.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any

from .jobs import CheckpointError

#: What a rank says about a checkpoint, and what rank 0 decides.
DURABLE, SKIPPED, FAILED, COMMITTED = "durable", "skipped", "failed", "committed"
_KEYS = ("statuses", "count", "all", "decision", "skip")


def checkpoint_key(root: str, checkpoint: str, tag: str) -> str:
    """The store prefix of one attempt at a checkpoint (roots are hashed: keys stay short)."""
    digest = hashlib.sha1(os.path.abspath(root).encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{digest}/{checkpoint}/{tag}"


class CommitChannel:
    """One rank's end of the commit conversation (``waiting`` blocks, ``notices`` never does).

    A blocking ``wait`` holds a TCPStore client for its whole length, so the committer thread
    gets a client of its own (``waiting``) and the short calls other threads make (skip notices,
    failures) go through ``notices``. In one process (tests, the commit benchmark) both may be the
    same thread-safe store.
    """

    def __init__(self, waiting: Any, notices: Any, rank: int, world_size: int):
        self.waiting = waiting
        self.notices = notices
        self.rank = rank
        self.world_size = world_size
        self._settled: list[str] = []  # rank 0: checkpoints collected whose keys are not deleted yet

    # ------------------------------------------------------------------ every rank
    def post(self, key: str, status: dict, *, from_committer: bool = True) -> None:
        """This rank's one status for checkpoint ``key`` (the caller makes sure it is the only one)."""
        store = self.waiting if from_committer else self.notices
        line = json.dumps(dict(status, rank=self.rank), separators=(",", ":")) + "\n"
        store.append(f"{key}/statuses", line)
        if store.add(f"{key}/count", 1) == self.world_size:
            store.set(f"{key}/all", b"1")

    def notify_skip(self, key: str, detail: dict) -> None:
        """Tell the other ranks early that this rank skips ``key`` (the first skipper's reason stays)."""
        self.notices.compare_set(f"{key}/skip", "", json.dumps(dict(detail, rank=self.rank)))

    def peer_skip(self, key: str) -> dict | None:
        """The reason another rank gave for skipping ``key``, if one did (one ``check``, no wait)."""
        if not self.notices.check([f"{key}/skip"]):
            return None
        return _loads(self.notices.get(f"{key}/skip"), f"{key}/skip")

    def await_decision(self, key: str, timeout_s: float) -> dict:
        """Rank 0's decision on ``key``; a ``CheckpointError`` if none comes within ``timeout_s``."""
        try:
            self.waiting.wait([f"{key}/decision"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # DistStoreError on timeout, or the store's server is gone
            if not _is_timeout(exc):
                raise CheckpointError(f"the commit store failed while waiting for rank 0: {exc}") from exc
            raise CheckpointError(f"rank 0 did not decide within {timeout_s:.0f}s (rank 0 is gone or "
                                  "stuck, or a rank never reported)") from None
        return _loads(self.waiting.get(f"{key}/decision"), f"{key}/decision")

    # ------------------------------------------------------------------ rank 0
    def collect(self, key: str, timeout_s: float) -> tuple[list[dict], list[int]]:
        """Every rank's status of ``key`` and the ranks missing (none unless ``timeout_s`` ran out).

        With every status in, every rank is done with the checkpoints before (module docstring):
        their keys are deleted here.
        """
        try:
            self.waiting.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            if not _is_timeout(exc):
                raise CheckpointError(f"the commit store failed while waiting for the ranks: {exc}") from exc
        statuses = self._statuses(self.waiting, key)
        missing = [r for r in range(self.world_size) if r not in statuses]
        if not missing:
            for old in self._settled:
                for name in _KEYS:
                    self.waiting.delete_key(f"{old}/{name}")
            self._settled = []
        self._settled.append(key)
        return [statuses[r] for r in sorted(statuses)], missing

    def missing(self, key: str) -> list[int]:
        """The ranks whose status of ``key`` is not in yet (for messages; one ``get``, no wait)."""
        statuses = self._statuses(self.notices, key)
        return [r for r in range(self.world_size) if r not in statuses]

    def settle(self, key: str, decision: dict) -> dict:
        """Publish ``decision`` unless one is already there; returns the one that stands."""
        raw = self.notices.compare_set(f"{key}/decision", "", json.dumps(decision, separators=(",", ":")))
        return _loads(raw, f"{key}/decision")

    def _statuses(self, store: Any, key: str) -> dict[int, dict]:
        raw = store.get(f"{key}/statuses") if store.check([f"{key}/statuses"]) else b""
        statuses: dict[int, dict] = {}
        for line in raw.decode("utf-8").splitlines():
            status = _loads(line.encode(), f"{key}/statuses")
            statuses.setdefault(status["rank"], status)
        return statuses


def _loads(raw: bytes, where: str) -> dict:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"commit store key {where}: not JSON ({exc})") from None
    if type(value) is not dict or ("rank" in value and type(value["rank"]) is not int):
        raise CheckpointError(f"commit store key {where}: unexpected value {str(value)[:200]}")
    return value


def _is_timeout(exc: Exception) -> bool:
    return "timeout" in str(exc).lower() or "timed out" in str(exc).lower()


def open_stores(run_id: str, timeout_s: float, world_size: int, store: Any = None,
                private: bool = False) -> tuple[Any, Any]:
    """(waiting, notices) stores under this run's prefix.

    ``store`` given (in-process ranks, the benchmark): both are that store. Otherwise the default
    process group's store; a TCPStore gets a second client connection for the waiting side. One
    process without a process group (or ``private``: an engine that commits nothing) gets a
    private in-memory store.
    """
    import torch.distributed as dist

    prefix = f"datastates/{run_id}/"
    if store is not None:
        return dist.PrefixStore(prefix, store), dist.PrefixStore(prefix, store)
    if private or not (dist.is_available() and dist.is_initialized()):
        if world_size > 1 and not private:
            raise CheckpointError(f"world_size {world_size} without torch.distributed: pass the ranks' "
                                  "shared store (commit_store=) so they can agree on commits")
        local = dist.HashStore()
        return dist.PrefixStore(prefix, local), dist.PrefixStore(prefix, local)
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_store()  # the rendezvous store every rank already reaches
    base = default
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        waiting = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=max(timeout_s, 60.0)))
        return dist.PrefixStore(prefix, waiting), dist.PrefixStore(prefix, base)
    return dist.PrefixStore(prefix, default), dist.PrefixStore(prefix, default)
