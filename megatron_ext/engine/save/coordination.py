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
  increment reaches the world size sets ``all``. A durable rank first appends its *record* to
  ``shares``: its head and its shares of the manifest, encoded and checked by itself
  (``manifest.check_share``), framed by bytes strict JSON never holds; then to ``statuses`` the
  number ``rank * 2**64 + digest``, the record's xxh3-64 seeded by this attempt's key and the
  world size. Rank 0 reads ``shares`` as one value, every rank's record joined by the store,
  splits it at the framing bytes and hashes each record (``open_shares``): a
  record that changed on its way, or that no rank posted, fails the checkpoint, naming the rank;
  the manifest is never parsed. A rank that skips or fails appends an object. Per rank: three store operations to post (four for
  the rank that sets ``all``), whatever the world size.
* ``decision``: rank 0 waits for ``all``, reads the statuses and the records in one ``multi_get``,
  decides (``committed``, ``skipped``, ``failed``) and sets it; first writer wins
  (``compare_set``), so a rank 0 that fails while others wait settles its open checkpoints at
  once. The other ranks wait for it.
* ``skip``: the first rank that skips the checkpoint leaves its reason here, so the others can
  drop their copy before the decision (``peer_skip``, one ``check``).

Every rank processes its checkpoints in the order it asked to commit them, the same on every rank
(training is SPMD), so when rank 0 has every status of a later checkpoint, no rank reads an older
one's keys any more and rank 0 deletes them: the store holds O(1) checkpoints' keys.

Each store call releases the GIL and takes it back on the committer thread: a switch for a
Python-bound training thread. So a commit costs every rank but 0 five calls (posting, then ``wait``
and ``get`` of the decision; six for the rank that sets ``all``) and rank 0 about fourteen,
none of them per rank or per file.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import operator
import os
from typing import Any, Mapping

import xxhash

from ..errors import CheckpointError

#: What a rank says about a checkpoint it will not commit (else it posts a durable head), and what
#: rank 0 decides.
SKIPPED, FAILED, COMMITTED = "skipped", "failed", "committed"
_KEYS = ("statuses", "shares", "count", "all", "decision")  # and "skip" where a rank skipped
#: Framing of ``shares``: each record starts with RECORD; its head and its shares are separated by
#: PART. Strict JSON holds neither byte (``manifest.FRAMING_BYTES``), so rank 0 splits at C speed.
RECORD, PART = b"\x1e", b"\x1f"
_DIGEST = (1 << 64) - 1  # a durable status is rank * 2**64 + its record's digest


class DecisionTimeout(CheckpointError):
    """No decision came within the wait; the caller judges whether rank 0 is still deciding."""


class ShareDamaged(CheckpointError):
    """The records in ``shares`` are not the ones the durable ranks posted; ``rank``: the first rank
    whose record did not arrive intact (None: a record no rank posted, or bytes outside any record)."""

    def __init__(self, message: str, rank: int | None):
        super().__init__(message)
        self.rank = rank


def share_seed(key: str, world_size: int) -> int:
    """The seed of a record's digest: a record checked for another attempt, root or world size (the
    key names root, checkpoint and tag) never matches the digest rank 0 computes."""
    return xxhash.xxh3_64_intdigest(f"{key}#{world_size}".encode("utf-8", "surrogatepass"))


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
        # Rank 0: collected, keys not deleted yet (key, whether every rank was durable: then no rank
        # left a ``skip`` key).
        self._settled: list[tuple[str, bool]] = []

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
        and ``shares`` (bytes that passed ``manifest.check_share``, in ``MANIFEST_SHARES`` order).

        One record, ``RECORD [rank, *head] PART share PART share``, goes to ``shares``, then
        ``rank * 2**64 + digest`` to ``statuses``: a status in means its record is in, and rank 0
        holds the record to the digest without decoding more than the head (``open_shares``).
        """
        record = PART.join((json.dumps([self.rank, *head], separators=(",", ":")).encode(), *shares.values()))
        self.waiting.append(f"{key}/shares", RECORD + record)
        digest = xxhash.xxh3_64_intdigest(record, share_seed(key, self.world_size))
        self.waiting.append(f"{key}/statuses", b",%d" % (self.rank << 64 | digest))
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
    def collect(self, key: str, timeout_s: float) -> "Collected":
        """Every rank's status of ``key`` once all are in (or ``timeout_s`` ran out: then some are
        missing), and the durable ranks' records as the store joined them (``open_shares``).

        With every status in, every rank is done with the checkpoints before (module docstring):
        their keys are deleted here.
        """
        store = self.waiting
        share_keys = [f"{key}/shares"]
        try:
            store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            if not _is_timeout(exc):
                raise CheckpointError(f"the commit store failed while waiting for the ranks: {exc}") from exc
            everyone = False
        else:
            everyone = True
        if everyone and store.check(share_keys):  # the usual case: two calls
            raw, records = store.multi_get([f"{key}/statuses", *share_keys])
        else:  # nobody durable, or some rank never posted: key by key, none waited for
            raw = self._get(store, f"{key}/statuses")
            records = self._get(store, share_keys[0])
        durable, others = self._decode(raw, key)
        missing = self._missing(durable, others)
        if not missing:
            for old, clean in self._settled:
                for name in _KEYS + (() if clean else ("skip",)):
                    store.delete_key(f"{old}/{name}")
            self._settled = []
        self._settled.append((key, not others and not missing))
        return Collected(durable, others, missing, records)

    def open_shares(self, key: str, collected: "Collected", names: tuple[str, ...]) -> tuple[list[list], dict[str, bytes]]:
        """Rank 0, every rank durable: the heads ``[rank, *head]`` in rank order and, for each of
        ``names``, every rank's share joined, from records that arrived exactly as posted.

        The records are split at their framing bytes and each hashed (C speed, no JSON parsed but
        the heads): their digests must be, as a set, the ones the statuses carry. The ranks
        checked their records' contents (``manifest.check_share``), so an intact record needs no
        re-parsing here; a damaged or foreign one is a ``ShareDamaged`` naming the rank whose
        record did not arrive.
        """
        seed = share_seed(key, self.world_size)
        records = collected.records.split(RECORD)
        want = set(map(operator.and_, collected.durable, itertools.repeat(_DIGEST)))
        if records[0] or len(records) != 1 + len(collected.durable) or len(want) != len(collected.durable):
            raise self._damaged(collected, records, seed)
        del records[0]
        if set(map(xxhash.xxh3_64_intdigest, records, itertools.repeat(seed))) != want:
            raise self._damaged(collected, records, seed)
        width = 1 + len(names)
        parts = collected.records.replace(RECORD, PART).split(PART)
        try:
            if len(parts) != 1 + width * len(records):  # intact, but its own rank framed it wrongly (a bug)
                raise ValueError(f"a record does not have {width} parts")
            del parts[0]
            heads = json.loads(b"[" + b",".join(parts[0::width]) + b"]")
            heads.sort(key=operator.itemgetter(0))
        except (ValueError, TypeError, IndexError) as exc:
            raise ShareDamaged(f"a record of the manifest is not [rank, ...] and {width - 1} shares: {exc}",
                               None) from None
        return heads, {name: b"".join(parts[i::width]) for i, name in enumerate(names, 1)}

    @staticmethod
    def _damaged(collected: "Collected", records: list[bytes], seed: int) -> ShareDamaged:
        """Which rank's record did not arrive as posted, or which rank a record no status vouches
        for claims to be (only once the records failed the check, so cost does not matter)."""
        digests = [xxhash.xxh3_64_intdigest(record, seed) for record in records]
        found = set(digests)
        lost = sorted(status >> 64 for status in collected.durable if status & _DIGEST not in found)
        if lost:
            return ShareDamaged(f"rank {lost[0]}'s share of the manifest did not arrive as it posted it (no record in "
                                "the commit store has the digest its status carries: damaged or replaced on its way)"
                                + (f"; nor did those of ranks {lost[1:4]}" if len(lost) > 1 else ""), lost[0])
        rank_of = {status & _DIGEST: status >> 64 for status in collected.durable}
        seen: set[int] = set()
        twice = sorted({rank_of[d] for d in digests if d in rank_of and (d in seen or seen.add(d))})
        if twice:
            return ShareDamaged(f"rank {twice[0]}'s share of the manifest is in the commit store twice", twice[0])
        for record, digest in zip(records, digests):
            if record and digest not in rank_of:
                try:
                    claimed = json.loads(record.split(PART, 1)[0])[0]
                except (ValueError, TypeError, IndexError, KeyError):
                    continue
                if type(claimed) is int:
                    return ShareDamaged(f"the commit store holds a share of the manifest that says it is rank "
                                        f"{claimed}'s, which no status vouches for (posted by a stranger, such as "
                                        "another job's rank on a reused port, or for another attempt)", claimed)
        return ShareDamaged(f"the commit store holds {collected.records.count(RECORD)} records of the manifest for "
                            f"{len(collected.durable)} durable ranks, or bytes outside any record: a record no rank "
                            "can be named for", None)

    def missing(self, key: str) -> list[int]:
        """The ranks whose status of ``key`` is not in yet (for messages; two ``get``, no wait)."""
        return self._missing(*self._statuses(self.notices, key))

    def settle(self, key: str, decision: dict) -> dict:
        """Publish ``decision`` unless one is already there; returns the one that stands."""
        raw = self.notices.compare_set(f"{key}/decision", "", json.dumps(decision, separators=(",", ":")))
        return _loads(raw, f"{key}/decision")

    def _missing(self, durable: list[int], others: list[dict]) -> list[int]:
        seen = set(map(operator.rshift, durable, itertools.repeat(64))) | {status["rank"] for status in others}
        return [r for r in range(self.world_size) if r not in seen]

    @staticmethod
    def _get(store: Any, key: str) -> bytes:
        return store.get(key) if store.check([key]) else b""

    def _statuses(self, store: Any, key: str) -> tuple[list[int], list[dict]]:
        return self._decode(self._get(store, f"{key}/statuses"), key)

    @staticmethod
    def _decode(raw: bytes, key: str) -> tuple[list[int], list[dict]]:
        """The durable statuses (numbers, ``rank * 2**64 + digest``) and the other statuses
        (objects, sorted by rank) in ``raw``, the key's ``,x,y,...`` as the store concatenated
        them, decoded in one call."""
        statuses = _loads(b"[" + raw[1:] + b"]", f"{key}/statuses", list)
        durable = [s for s in statuses if type(s) is int]
        others = [s for s in statuses if type(s) is not int]
        if durable and min(durable) < 0:
            raise CheckpointError(f"commit store key {key}/statuses: unexpected value {min(durable)}")
        if not all(type(s) is dict and type(s.get("rank")) is int for s in others):
            raise CheckpointError(f"commit store key {key}/statuses: unexpected value {str(others)[:200]}")
        others.sort(key=lambda status: status["rank"])
        return durable, others


@dataclasses.dataclass
class Collected:
    """What rank 0 has of one checkpoint: the durable ranks' statuses (``rank * 2**64 + digest``),
    the other ranks' statuses (sorted by rank), the ranks missing, and the durable ranks' records
    as the store joined them (``open_shares``)."""

    durable: list[int]
    others: list[dict]
    missing: list[int]
    records: bytes


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
