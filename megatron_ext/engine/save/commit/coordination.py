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

*Groups.* Rank 0's work above is O(ranks): at 4,096 ranks, tens of thousands of Python objects per
commit. So ranks are grouped (``CommitGroups``: consecutive ranks, about the square root of the world
size to a group). A rank posts exactly as above, but under ``<tag>/g<group>/`` and counting to its
group's size; the group's first rank, its *leader*, collects its group as rank 0 would, checks the
records (``open_shares``) and condenses their heads (``[bytes, versions, names...]``), then posts one
record for the group to the keys above (``group * 2**64 + digest``; ``count`` reaches the number of
groups): its condensed head and its members' shares joined. A group with a rank that skipped or failed
forwards those statuses instead; one with a damaged record forwards a failure naming its rank; one not
complete in time forwards nothing, and rank 0, when its own wait runs out, reads that group's keys to
name the missing ranks (or the leader, if they all posted). A leader whose engine fails forwards its
own failure for its group at once (``forward_failed``): its committer, which forwards, may be gone.

Every rank processes its checkpoints in the order it asked to commit them, the same on every rank
(training is SPMD), so when rank 0 has every status of a later checkpoint, no rank reads an older
one's keys any more and rank 0 deletes them; a leader deletes its group's the same way: the store
holds O(1) checkpoints' keys.

Each store call releases the GIL and takes it back on the committer thread: a switch for a
Python-bound training thread. So a commit costs every rank but 0 five calls (posting, then ``wait``
and ``get`` of the decision; six for the rank that sets ``all``), a leader about twelve more (its
group's collection, its record, the deletion of its group's older keys), and rank 0 about twenty,
none of them per rank or per file.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import operator
import os
from typing import Any, Callable, Mapping

import xxhash

from ...errors import CheckpointError
from ...object_store import resolve_root
from ..job.skip import SkipRecord

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
    digest = hashlib.sha1(resolve_root(root).encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{digest}/{checkpoint}/{tag}"


@dataclasses.dataclass(frozen=True)
class CommitGroups:
    """Consecutive ranks, ``fan_in`` to a group, whose first rank (the group's *leader*) joins and
    checks its group's records and forwards them to rank 0 as one record: rank 0 then handles one
    record per group, not per rank. By default ``fan_in`` is the world size's square root, so a
    leader and rank 0 each handle about that many. One group (``fan_in`` at least the world
    size) is the flat protocol: every rank posts straight to rank 0.
    """

    world_size: int
    fan_in: int

    @classmethod
    def of(cls, world_size: int, fan_in: int | None = None) -> "CommitGroups":
        if fan_in is None:
            fan_in = max(2, math.isqrt(max(world_size - 1, 0)) + 1)  # the square root, rounded up
        return cls(world_size, max(1, min(fan_in, world_size)))

    @property
    def count(self) -> int:
        return -(-self.world_size // self.fan_in)

    @property
    def flat(self) -> bool:
        return self.count == 1

    def group_of(self, rank: int) -> int:
        return rank // self.fan_in

    def ranks(self, group: int) -> range:
        return range(group * self.fan_in, min(self.world_size, (group + 1) * self.fan_in))

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` forwards its group (no rank does in a flat commit)."""
        return not self.flat and rank % self.fan_in == 0


@dataclasses.dataclass(frozen=True)
class _Point:
    """Where members post their statuses and one rank collects them: every rank of a flat commit
    (rank 0 collects), the ranks of one group (its leader collects), or the groups of a grouped
    commit (their leaders post, rank 0 collects)."""

    key: str
    members: range  # ranks; group numbers at the top of a grouped commit
    seed: int
    groups: CommitGroups | None = None  # set at the top of a grouped commit

    def member_of(self, rank: int) -> int:
        """The member a status object (it names a rank) counts for."""
        return rank if self.groups is None else self.groups.group_of(rank)

    def rank_of(self, member: int) -> int:
        """The rank that posted for ``member``: the rank itself, or its group's leader."""
        return member if self.groups is None else self.groups.ranks(member).start

    def shares_of(self, member: int) -> str:
        """What ``member`` posts, for messages."""
        if self.groups is None:
            return f"rank {member}'s share of the manifest"
        ranks = self.groups.ranks(member)
        return f"the shares of the manifest of ranks {ranks.start}-{ranks.stop - 1} (forwarded by rank {ranks.start})"


class CommitChannel:
    """One rank's end of the commit conversation (``waiting`` blocks, ``notices`` never does).

    A blocking ``wait`` holds a TCPStore client for its whole length, so the committer thread
    gets a client of its own (``waiting``) and the short calls other threads make (skip notices,
    failures) go through ``notices``. In one process (tests, the commit benchmark) both may be the
    same thread-safe store. ``groups``: how ranks are grouped (``CommitGroups``; None: flat).
    """

    def __init__(self, waiting: Any, notices: Any, rank: int, world_size: int, groups: CommitGroups | None = None):
        self.waiting = waiting
        self.notices = notices
        self.rank = rank
        self.world_size = world_size
        self.groups = groups if groups is not None else CommitGroups(world_size, max(world_size, 1))
        if self.groups.world_size != world_size:
            raise ValueError(f"commit groups of a world of {self.groups.world_size} for a world of {world_size}")
        self.leads = self.groups.leads(rank)
        # Collected, keys not deleted yet: rank 0's checkpoints, a leader's group's (store prefix, key names).
        self._settled: list[tuple[str, tuple[str, ...]]] = []
        self._group_settled: list[tuple[str, tuple[str, ...]]] = []

    # ------------------------------------------------------------------ where statuses go
    def _top(self, key: str) -> _Point:
        """Where rank 0 collects: every rank's status (flat), or every group's."""
        if self.groups.flat:
            return _Point(key, range(self.world_size), share_seed(key, self.world_size))
        return _Point(key, range(self.groups.count), share_seed(key, self.world_size), self.groups)

    def _group(self, key: str, group: int) -> _Point:
        prefix = f"{key}/g{group}"
        return _Point(prefix, self.groups.ranks(group), share_seed(prefix, self.world_size))

    def _own(self, key: str, rank: int | None = None) -> _Point:
        """Where ``rank`` (default: this one) posts its status of ``key``."""
        rank = self.rank if rank is None else rank
        return self._top(key) if self.groups.flat else self._group(key, self.groups.group_of(rank))

    # ------------------------------------------------------------------ every rank
    def post(self, key: str, status: dict, *, from_committer: bool = True) -> None:
        """This rank's one status for checkpoint ``key``, not durable (``skipped`` or ``failed``).

        The caller makes sure a rank posts one status per checkpoint, this or ``post_durable``.
        """
        store = self.waiting if from_committer else self.notices
        self._post_objects(store, self._own(key), [dict(status, rank=self.rank)])

    def post_durable(self, key: str, head: list, shares: Mapping[str, bytes]) -> None:
        """This rank's one status for ``key``: durable, with ``head`` (a JSON array rank 0 checks)
        and ``shares`` (bytes that passed ``manifest.check_share``, in ``MANIFEST_SHARES`` order).

        One record, ``RECORD [rank, *head] PART share PART share``, goes to ``shares``, then
        ``rank * 2**64 + digest`` to ``statuses``: a status in means its record is in, and the
        collector holds the record to the digest without decoding more than the head (``open_shares``).
        """
        record = PART.join((json.dumps([self.rank, *head], separators=(",", ":")).encode(), *shares.values()))
        self._post_record(self.waiting, self._own(key), self.rank, record)

    def _post_record(self, store: Any, point: _Point, member: int, record: bytes) -> None:
        store.append(f"{point.key}/shares", RECORD + record)
        digest = xxhash.xxh3_64_intdigest(record, point.seed)
        store.append(f"{point.key}/statuses", b",%d" % (member << 64 | digest))
        self._count(store, point)

    def _post_objects(self, store: Any, point: _Point, statuses: list[dict]) -> None:
        store.append(f"{point.key}/statuses",
                     b"".join(b"," + json.dumps(status, separators=(",", ":")).encode() for status in statuses))
        self._count(store, point)

    def _count(self, store: Any, point: _Point) -> None:
        if store.add(f"{point.key}/count", 1) == len(point.members):
            store.set(f"{point.key}/all", b"1")

    def notify_skip(self, key: str, record: SkipRecord) -> None:
        """Tell the other ranks early that this rank skips ``key`` (the first skipper's reason stays)."""
        self.notices.compare_set(f"{key}/skip", "", json.dumps(dict(record.fields(), rank=self.rank)))

    def peer_skip(self, key: str) -> SkipRecord | None:
        """Another rank's skip of ``key``, as this rank records it, if one did (one ``check``, no wait)."""
        if not self.notices.check([f"{key}/skip"]):
            return None
        notice = _loads(self.notices.get(f"{key}/skip"), f"{key}/skip")
        if type(notice) is not dict:
            raise CheckpointError(f"the commit store's {key}/skip is not a skip notice")
        return SkipRecord.from_peer(notice) if notice.get("rank") != self.rank else None

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

    # ------------------------------------------------------------------ a group's leader
    def forward(self, key: str, timeout_s: float, names: tuple[str, ...],
                condense: Callable[[list[list], range], list]) -> bool:
        """A group's leader: its group's statuses of ``key``, once all are in, forwarded to rank 0
        as one. A durable group: one record, ``[group, *condense(heads, ranks)]`` and the members'
        shares joined (``names``), once each member's record arrived intact; else the statuses of
        the members that skipped or failed, or a failure naming the member whose record did not
        arrive. Returns False if the group was not complete within ``timeout_s``: nothing is
        forwarded, and rank 0 names the missing ranks when its own wait runs out (``collect``).
        """
        group = self.groups.group_of(self.rank)
        collected = self._collect(self._group(key, group), timeout_s, self._group_settled, ())
        if collected.missing:
            return False
        top = self._top(key)
        if collected.others:
            self._post_objects(self.waiting, top, collected.others)
            return True
        try:
            heads, shares = self.open_shares(collected, names)
            summary = condense(heads, collected.point.members)
        except CheckpointError as exc:  # ShareDamaged, or heads that are not the group's ranks
            rank = exc.rank if isinstance(exc, ShareDamaged) and exc.rank is not None else self.rank
            self._post_objects(self.waiting, top, [{"state": FAILED, "rank": rank, "error": str(exc)}])
            return True
        pieces = [json.dumps([group, *summary], separators=(",", ":")).encode()]
        for name in names:
            pieces += (PART, *shares[name])
        self._post_record(self.waiting, top, group, b"".join(pieces))
        return True

    def forward_failed(self, key: str, status: dict) -> None:
        """A group's leader whose engine failed: its own failure stands for its group, at once
        (its committer, which forwards, may be gone; the checkpoint fails whatever the others say)."""
        self._post_objects(self.notices, self._top(key), [dict(status, rank=self.rank)])

    # ------------------------------------------------------------------ rank 0
    def collect(self, key: str, timeout_s: float) -> "Collected":
        """Every status of ``key`` once all are in (or ``timeout_s`` ran out: then some are
        missing), and the records as the store joined them (``open_shares``): every rank's in a
        flat commit, every group's in a grouped one.

        With every status in, every rank is done with the checkpoints before (module docstring):
        their keys are deleted here. If the wait ran out in a grouped commit, the ranks of the
        groups not forwarded are looked up in their groups' own keys: the ones that never posted
        are ``missing``; a group whose ranks all posted names its leader in ``unforwarded``.
        """
        top = self._top(key)
        collected = self._collect(top, timeout_s, self._settled, ("skip",))
        if top.groups is None or not collected.missing:
            return collected
        others, missing, unforwarded = self._in_groups(key, collected.missing)
        others = sorted(collected.others + others, key=lambda status: status["rank"])
        return dataclasses.replace(collected, others=others, missing=missing, unforwarded=unforwarded)

    def _in_groups(self, key: str, groups: list[int]) -> tuple[list[dict], list[int], list[int]]:
        """What the ranks of ``groups`` posted to their groups' own keys (groups not forwarded):
        the statuses of those that skipped or failed, the ranks that never posted, and the
        leaders of the groups whose ranks all posted. Two ``get`` per group, no wait."""
        others, missing, unforwarded = [], [], []
        for group in groups:
            point = self._group(key, group)
            durable, objects = self._statuses(self.notices, point)
            others += objects
            lost = self._missing(point, durable, objects)
            missing += lost
            if not lost:
                unforwarded.append(point.members.start)
        return others, missing, unforwarded

    def _collect(self, point: _Point, timeout_s: float, settled: list, unclean: tuple[str, ...]) -> "Collected":
        """The statuses and records posted to ``point`` once all its members posted (or the wait
        ran out); once all are in, the keys of the points collected before are deleted (with
        ``unclean`` too where a status was not durable)."""
        store = self.waiting
        shares = f"{point.key}/shares"
        try:
            store.wait([f"{point.key}/all"], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            if not _is_timeout(exc):
                raise CheckpointError(f"the commit store failed while waiting for the ranks: {exc}") from exc
            everyone = False
        else:
            everyone = True
        if everyone and store.check([shares]):  # the usual case: two calls
            raw, records = store.multi_get([f"{point.key}/statuses", shares])
        else:  # nobody durable, or some member never posted: key by key, none waited for
            raw = self._get(store, f"{point.key}/statuses")
            records = self._get(store, shares)
        durable, others = self._decode(raw, point.key)
        missing = self._missing(point, durable, others)
        if not missing:
            for old, names in settled:
                for name in names:
                    store.delete_key(f"{old}/{name}")
            settled.clear()
        settled.append((point.key, _KEYS if not others and not missing else _KEYS + unclean))
        return Collected(durable, others, missing, records, point)

    def open_shares(self, collected: "Collected", names: tuple[str, ...]) -> tuple[list[list], dict[str, list]]:
        """The collector, every member durable: the heads ``[member, *head]`` in member order and,
        for each of ``names``, every member's share (views of ``collected.records``, to be joined
        once, where they are written), from records that arrived exactly as posted.

        The records are found at their framing bytes and each hashed where it lies (views, no copy:
        on a loaded host a copy of the megabytes of records costs more in page faults than all the
        rest), no JSON parsed but the heads: their digests must be, as a set, the ones the statuses
        carry. The ranks checked their records' contents (``manifest.check_share``), so an intact
        record needs no re-parsing here; a damaged or foreign one is a ``ShareDamaged`` naming the
        rank whose record did not arrive.
        """
        seed = collected.point.seed
        blob = collected.records
        starts = _positions(blob, RECORD)
        ends = starts[1:] + [len(blob)]
        view = memoryview(blob)
        records = [view[start + 1:end] for start, end in zip(starts, ends)]
        want = set(map(operator.and_, collected.durable, itertools.repeat(_DIGEST)))
        if ((blob and starts[:1] != [0]) or len(records) != len(collected.durable)
                or len(want) != len(collected.durable)
                or set(map(xxhash.xxh3_64_intdigest, records, itertools.repeat(seed))) != want):
            raise self._damaged(collected, blob.split(RECORD), seed)
        width = 1 + len(names)
        columns: list[list[memoryview]] = [[] for _ in range(width)]
        find = blob.find
        try:
            for start, end in zip(starts, ends):  # one per member: O(groups) or O(group) where ranks are grouped
                at = part = start + 1
                for column in columns[:-1]:
                    part = find(PART, at, end)
                    if part < 0:
                        break
                    column.append(view[at:part])
                    at = part + 1
                if part < 0 or find(PART, at, end) >= 0:  # intact, but its own rank framed it wrongly (a bug)
                    raise ValueError(f"a record does not have {width} parts")
                columns[-1].append(view[at:end])
            heads = json.loads(b"[" + b",".join(columns[0]) + b"]")
            heads.sort(key=operator.itemgetter(0))
        except (ValueError, TypeError, IndexError) as exc:
            raise ShareDamaged(f"a record of the manifest is not [member, ...] and {width - 1} shares: {exc}",
                               None) from None
        return heads, dict(zip(names, columns[1:]))

    @staticmethod
    def _damaged(collected: "Collected", records: list[bytes], seed: int) -> ShareDamaged:
        """Which member's record did not arrive as posted, or which member a record no status vouches
        for claims to be (only once the records failed the check, so cost does not matter)."""
        point = collected.point
        digests = [xxhash.xxh3_64_intdigest(record, seed) for record in records]
        found = set(digests)
        lost = sorted(status >> 64 for status in collected.durable if status & _DIGEST not in found)
        if lost:
            return ShareDamaged(f"{point.shares_of(lost[0])} did not arrive as it was posted (no record in the commit "
                                "store has the digest its status carries: damaged or replaced on its way)"
                                + (f"; nor did those of ranks {[point.rank_of(m) for m in lost[1:4]]}"
                                   if len(lost) > 1 else ""), point.rank_of(lost[0]))
        member_of = {status & _DIGEST: status >> 64 for status in collected.durable}
        seen: set[int] = set()
        twice = sorted({member_of[d] for d in digests if d in member_of and (d in seen or seen.add(d))})
        if twice:
            return ShareDamaged(f"{point.shares_of(twice[0])} is in the commit store twice", point.rank_of(twice[0]))
        for record, digest in zip(records, digests):
            if record and digest not in member_of:
                try:
                    claimed = json.loads(record.split(PART, 1)[0])[0]
                except (ValueError, TypeError, IndexError, KeyError):
                    continue
                if type(claimed) is int and claimed in point.members:
                    return ShareDamaged(f"the commit store holds a record that says it is {point.shares_of(claimed)}, "
                                        "which no status vouches for (posted by a stranger, such as another job's "
                                        "rank on a reused port, or for another attempt)", point.rank_of(claimed))
        return ShareDamaged(f"the commit store holds {collected.records.count(RECORD)} records of the manifest for "
                            f"{len(collected.durable)} durable statuses at {point.key}, or bytes outside any record: "
                            "a record no rank can be named for", None)

    def missing(self, key: str, group: int | None = None) -> list[int]:
        """The ranks whose status of ``key`` is not in yet, of group ``group`` or of all (for
        messages: two ``get`` per point read, no wait)."""
        if group is not None:
            return self._in_groups(key, [group])[1]
        top = self._top(key)
        lost = self._missing(top, *self._statuses(self.notices, top))
        return lost if top.groups is None else self._in_groups(key, lost)[1]  # groups not forwarded yet

    def posted(self, key: str, rank: int) -> bool:
        """Whether ``rank`` posted its status of ``key`` (two ``get``, no wait)."""
        point = self._own(key, rank)
        return rank not in self._missing(point, *self._statuses(self.notices, point))

    def settle(self, key: str, decision: dict) -> dict:
        """Publish ``decision`` unless one is already there; returns the one that stands."""
        raw = self.notices.compare_set(f"{key}/decision", "", json.dumps(decision, separators=(",", ":")))
        return _loads(raw, f"{key}/decision")

    @staticmethod
    def _missing(point: _Point, durable: list[int], others: list[dict]) -> list[int]:
        seen = set(map(operator.rshift, durable, itertools.repeat(64)))
        seen.update(point.member_of(status["rank"]) for status in others)
        return [member for member in point.members if member not in seen]

    @staticmethod
    def _get(store: Any, key: str) -> bytes:
        return store.get(key) if store.check([key]) else b""

    def _statuses(self, store: Any, point: _Point) -> tuple[list[int], list[dict]]:
        return self._decode(self._get(store, f"{point.key}/statuses"), point.key)

    @staticmethod
    def _decode(raw: bytes, key: str) -> tuple[list[int], list[dict]]:
        """The durable statuses (numbers, ``member * 2**64 + digest``) and the other statuses
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
    """What a collector has of one checkpoint at ``point``: the durable members' statuses
    (``member * 2**64 + digest``), the statuses of ranks that skipped or failed (sorted by rank),
    the members missing (at rank 0: ranks) and the durable members' records as the store joined
    them (``open_shares``). ``unforwarded``: the leaders of groups whose ranks all posted but that
    did not reach rank 0 in time."""

    durable: list[int]
    others: list[dict]
    missing: list[int]
    records: bytes
    point: _Point
    unforwarded: list[int] = dataclasses.field(default_factory=list)


def _positions(blob: bytes, byte: bytes) -> list[int]:
    """Where ``byte`` occurs in ``blob`` (a C-speed scan per occurrence, nothing copied)."""
    found, find = [], blob.find
    at = find(byte)
    while at >= 0:
        found.append(at)
        at = find(byte, at + 1)
    return found


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
