"""How ranks agree on a commit: statuses in, one decision out, over a key-value store.

Polling the shared file system for other ranks' reports costs every rank metadata operations
all the time a commit is pending (with a checkpoint every iteration: always), which a Lustre or
GPFS metadata server shared by a whole cluster feels at hundreds of ranks. So only the durable
record goes to the file system (each rank's report, rank 0's manifest: O(1) files per rank);
who is done, who skipped or failed, and what rank 0 decided travel through a
``torch.distributed`` store (the job's TCPStore, the one ``init_process_group`` rendezvoused
on), whose ``wait`` blocks on the server without polling.

Per checkpoint attempt, under ``<root digest>/<checkpoint>/<tag>/``:

* ``statuses``: every rank appends exactly one status and increments ``count``; the rank whose
  increment reaches the world size sets ``all``. A durable rank appends a small array, after its
  share of the manifest, already encoded, to ``share.files`` and ``share.reports`` (always both,
  empty or not, so that both exist once any rank is durable): rank 0 reads each as one value,
  every rank's shares joined by the store, and decodes none of them. A rank that skips or fails
  appends an object. Per rank: four store operations to post (five for the rank that sets
  ``all``), whatever the world size.
* ``decision``: rank 0 waits for ``all``, reads the statuses and the shares in one ``multi_get``,
  decides (``committed``, ``skipped``, ``failed``) and sets it; first writer wins
  (``compare_set``), so a rank 0 that fails while others wait settles its open checkpoints at
  once. The other ranks wait for it.
* ``skip``: the first rank that skips the checkpoint leaves its reason here, so the others can
  drop their copy before the decision (``peer_skip``, one ``check``).

Every rank processes its checkpoints in the order it asked to commit them, the same on every rank
(training is SPMD), so when rank 0 has every status of a later checkpoint, no rank reads an older
one's keys any more and rank 0 deletes them: the store holds O(1) checkpoints' keys.

Each store call releases the GIL and takes it back on the committer thread: a switch for a
Python-bound training thread. So a commit costs every rank but 0 six calls (posting, then ``wait``
and ``get`` of the decision; seven for the rank that sets ``all``) and rank 0 about fourteen,
none of them per rank or per file.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any, Mapping

from ..errors import CheckpointError

#: What a rank says about a checkpoint it will not commit (else it posts a durable head), and what
#: rank 0 decides.
SKIPPED, FAILED, COMMITTED = "skipped", "failed", "committed"
_KEYS = ("statuses", "count", "all", "decision")  # and "skip" where a rank skipped


class DecisionTimeout(CheckpointError):
    """No decision came within the wait; the caller judges whether rank 0 is still deciding."""


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
        # Rank 0: collected, keys not deleted yet (key, share names, whether every rank was durable:
        # then no rank left a ``skip`` key).
        self._settled: list[tuple[str, tuple[str, ...], bool]] = []

    # ------------------------------------------------------------------ every rank
    def post(self, key: str, status: dict, *, from_committer: bool = True) -> None:
        """This rank's one status for checkpoint ``key``, not durable (``skipped`` or ``failed``).

        The caller makes sure a rank posts one status per checkpoint, this or ``post_durable``.
        """
        store = self.waiting if from_committer else self.notices
        store.append(f"{key}/statuses", b"," + json.dumps(dict(status, rank=self.rank), separators=(",", ":")).encode())
        self._count(store, key)

    def post_durable(self, key: str, head: list, shares: Mapping[str, bytes]) -> None:
        """This rank's one status for ``key``: durable, with ``head`` (a JSON array rank 0 checks)
        and ``shares``, bytes appended to the key ``share.<name>`` as they are.

        Rank 0 reads every rank's share of a name as one value the store concatenated and never
        splits or decodes them; the heads, arrays, decode at a third of objects' cost. The shares
        go first: a head in means its shares are in.
        """
        for name, share in shares.items():
            self.waiting.append(f"{key}/share.{name}", share)
        self.waiting.append(f"{key}/statuses", b"," + json.dumps([self.rank, *head], separators=(",", ":")).encode())
        self._count(self.waiting, key)

    def _count(self, store: Any, key: str) -> None:
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
        """Rank 0's decision on ``key``; ``DecisionTimeout`` if none comes within ``timeout_s``."""
        try:
            self.waiting.wait([f"{key}/decision"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # DistStoreError on timeout, or the store's server is gone
            if not _is_timeout(exc):
                raise CheckpointError(f"the commit store failed while waiting for rank 0: {exc}") from exc
            raise DecisionTimeout(f"rank 0 did not decide within {timeout_s:.0f}s (rank 0 is gone or "
                                  "stuck, or a rank never reported)") from None
        return _loads(self.waiting.get(f"{key}/decision"), f"{key}/decision")

    # ------------------------------------------------------------------ rank 0
    def collect(self, key: str, timeout_s: float, shares: tuple[str, ...] = ()) -> "Collected":
        """Every rank's status of ``key`` once all are in (or ``timeout_s`` ran out: then some are
        missing), and for each name in ``shares`` every rank's share joined (in arrival order).

        With every status in, every rank is done with the checkpoints before (module docstring):
        their keys are deleted here.
        """
        store = self.waiting
        share_keys = [f"{key}/share.{name}" for name in shares]
        try:
            store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            if not _is_timeout(exc):
                raise CheckpointError(f"the commit store failed while waiting for the ranks: {exc}") from exc
            everyone = False
        else:
            everyone = True
        if everyone and share_keys and store.check(share_keys):  # the usual case: two calls
            raw, *values = store.multi_get([f"{key}/statuses", *share_keys])
        else:  # nobody durable, or some rank never posted: key by key, none waited for
            raw = self._get(store, f"{key}/statuses")
            values = [self._get(store, k) for k in share_keys]
        durable, others = self._decode(raw, key)
        missing = self._missing(durable, others)
        if not missing:
            for old, names, clean in self._settled:
                extra = () if clean else ("skip",)
                for name in _KEYS + extra + tuple(f"share.{n}" for n in names):
                    store.delete_key(f"{old}/{name}")
            self._settled = []
        self._settled.append((key, shares, not others and not missing))
        return Collected(durable, others, missing, dict(zip(shares, values)))

    def missing(self, key: str) -> list[int]:
        """The ranks whose status of ``key`` is not in yet (for messages; two ``get``, no wait)."""
        return self._missing(*self._statuses(self.notices, key))

    def settle(self, key: str, decision: dict) -> dict:
        """Publish ``decision`` unless one is already there; returns the one that stands."""
        raw = self.notices.compare_set(f"{key}/decision", "", json.dumps(decision, separators=(",", ":")))
        return _loads(raw, f"{key}/decision")

    def _missing(self, durable: list[list], others: list[dict]) -> list[int]:
        seen = {head[0] for head in durable} | {status["rank"] for status in others}
        return [r for r in range(self.world_size) if r not in seen]

    @staticmethod
    def _get(store: Any, key: str) -> bytes:
        return store.get(key) if store.check([key]) else b""

    def _statuses(self, store: Any, key: str) -> tuple[list[list], list[dict]]:
        return self._decode(self._get(store, f"{key}/statuses"), key)

    @staticmethod
    def _decode(raw: bytes, key: str) -> tuple[list[list], list[dict]]:
        """The durable heads (arrays) and the other statuses (objects) in ``raw``, the key's
        ``,x,y,...`` as the store concatenated them, decoded in one call; each sorted by rank."""
        statuses = _loads(b"[" + raw[1:] + b"]", f"{key}/statuses", list)
        durable = [h for h in statuses if type(h) is list]
        others = [s for s in statuses if type(s) is not list]
        if not all(h and type(h[0]) is int for h in durable):
            raise CheckpointError(f"commit store key {key}/statuses: unexpected value {str(durable)[:200]}")
        if not all(type(s) is dict and type(s.get("rank")) is int for s in others):
            raise CheckpointError(f"commit store key {key}/statuses: unexpected value {str(others)[:200]}")
        durable.sort()
        others.sort(key=lambda status: status["rank"])
        return durable, others


@dataclasses.dataclass
class Collected:
    """What rank 0 has of one checkpoint: the durable ranks' heads (``[rank, ...]``) and the other
    ranks' statuses, each sorted by rank, the ranks missing, and the joined shares by name."""

    durable: list[list]
    others: list[dict]
    missing: list[int]
    shares: dict[str, bytes]


def _loads(raw: bytes, where: str, kind: type = dict) -> Any:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"commit store key {where}: not JSON ({exc})") from None
    if type(value) is not kind or (kind is dict and "rank" in value and type(value["rank"]) is not int):
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
