"""The grouped commit (``CommitGroups``): each group's leader joins and checks its ranks' records and
forwards one, so rank 0 handles one record per group.

The oracle is the flat protocol: the same ranks' shares give the same manifest either way. Then what
can go wrong in the extra hop: a member's record damaged on its way to the leader, a group's record
damaged on its way to rank 0, a member that skips, one that never posts, a leader that never
forwards. Engines committing through groups (the store's keys bounded, failures of a leader or a
member of another group, a leader whose committer dies) are in test_commit_store.py.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch.distributed as dist

from megatron_ext.engine.format.manifest import (
    MANIFEST_SHARES,
    assemble_manifest,
    manifest_part,
    merge_summaries,
    summarize_heads,
)
from megatron_ext.engine.format.validation import validate_manifest
from megatron_ext.engine.save.commit.coordination import CommitChannel, CommitGroups, ShareDamaged

from helpers.states import FAST, TINY

RUN, CKPT, KEY = "0123456789ab", "iter_0000007", "k/c/t"


def _share(rank: int, names: tuple[str, ...] | None = None) -> tuple[list, dict[str, bytes]]:
    names = (f"rank{rank:05d}",) if names is None else names
    return manifest_part({
        "rank": rank, "version": 7,
        "report": {"file": f"{CKPT}/.reports/rank-{rank:05d}.{RUN}.json", "size": 300 + rank, "xxh3_64": f"{rank:016x}"},
        "files": [{"name": n, "tensor_file": f"{CKPT}/{n}.{RUN}.safetensors", "state_file": f"{CKPT}/{n}.{RUN}.state.json",
                   "size": 4096 + rank, "state_size": 10, "xxh3_64": "0" * 16, "state_xxh3_64": "f" * 16}
                  for n in names]})


def _channels(store, world: int, fan_in: int | None) -> list[CommitChannel]:
    groups = CommitGroups.of(world, fan_in)
    return [CommitChannel(store, store, rank, world, groups) for rank in range(world)]


def _post_all(channels: list[CommitChannel], skip: tuple[int, ...] = (), key: str = KEY, statuses=None) -> None:
    for channel in channels:
        if channel.rank in skip:
            continue
        if statuses and channel.rank in statuses:
            channel.post(key, statuses[channel.rank])
        else:
            channel.post_durable(key, *_share(channel.rank))


def _forward_all(channels: list[CommitChannel], key: str = KEY, timeout_s: float = 5.0, but=()) -> list[bool]:
    return [channel.forward(key, timeout_s, MANIFEST_SHARES, functools.partial(summarize_heads, CKPT))
            for channel in channels if channel.leads and channel.rank not in but]


def _manifest(channel: CommitChannel, key: str = KEY) -> dict:
    collected = channel.collect(key, 5.0)
    assert collected.missing == [] and collected.others == [] and collected.unforwarded == []
    heads, shares = channel.open_shares(collected, MANIFEST_SHARES)
    groups = channel.groups
    summary = (summarize_heads(CKPT, heads, range(channel.world_size)) if groups.flat
               else merge_summaries(CKPT, heads, groups.count))
    _, data = assemble_manifest(CKPT, RUN, 7, channel.world_size, summary, shares)
    doc = validate_manifest(json.loads(data), CKPT, "manifest")
    del doc["committed_at"]
    return doc


def test_the_groups_cover_every_rank_once():
    for world in (1, 2, 3, 4, 7, 8, 64, 65, 180, 4096):
        groups = CommitGroups.of(world)
        ranks = [rank for group in range(groups.count) for rank in groups.ranks(group)]
        assert ranks == list(range(world)), world
        assert all(groups.group_of(rank) == group for group in range(groups.count) for rank in groups.ranks(group))
        assert groups.flat == (world <= 2) and groups.fan_in * groups.fan_in >= world
    assert CommitGroups.of(4096).count == 64 and CommitGroups.of(4096, 4096).flat


@pytest.mark.parametrize("world, fan_in", [(7, 3), (6, 2), (5, 4), (9, None)])
def test_grouped_and_flat_commits_assemble_the_same_manifest(world, fan_in):
    flat = _channels(dist.HashStore(), world, world)
    _post_all(flat)
    grouped = _channels(dist.HashStore(), world, fan_in)
    assert not grouped[0].groups.flat
    _post_all(grouped)
    assert all(_forward_all(grouped))
    want = _manifest(flat[0])
    assert sorted(want["files"]) == [f"rank{r:05d}" for r in range(world)] and len(want["reports"]) == world
    assert _manifest(grouped[0]) == want


def test_a_member_record_damaged_before_its_leader_fails_the_checkpoint_naming_the_member():
    store = dist.HashStore()
    channels = _channels(store, 7, 3)
    _post_all(channels)
    blob = store.get(f"{KEY}/g1/shares")  # ranks 3-5; rank 4's record is the second
    at = blob.index(b"\x1e[4,") + 40
    store.set(f"{KEY}/g1/shares", blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:])
    assert all(_forward_all(channels))
    collected = channels[0].collect(KEY, 5.0)
    assert collected.missing == [] and [s["rank"] for s in collected.others] == [4]
    assert collected.others[0]["state"] == "failed"
    assert "rank 4's share of the manifest did not arrive" in collected.others[0]["error"]


def test_a_group_record_damaged_before_rank_0_names_its_leader():
    store = dist.HashStore()
    channels = _channels(store, 7, 3)
    _post_all(channels)
    assert all(_forward_all(channels))
    blob = store.get(f"{KEY}/shares")
    at = blob.index(b"\x1e[2,") + 30  # group 2: rank 6 alone
    store.set(f"{KEY}/shares", blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:])
    with pytest.raises(ShareDamaged, match=r"the shares of the manifest of ranks 6-6 \(forwarded by rank 6\) did "
                                           r"not arrive") as caught:
        channels[0].open_shares(channels[0].collect(KEY, 5.0), MANIFEST_SHARES)
    assert caught.value.rank == 6


def test_a_member_that_skips_reaches_rank_0_through_its_leader():
    channels = _channels(dist.HashStore(), 7, 3)
    _post_all(channels, statuses={5: {"state": "skipped", "reason": "superseded"}})
    assert all(_forward_all(channels))
    collected = channels[0].collect(KEY, 5.0)
    assert collected.missing == [] and collected.others == [{"state": "skipped", "reason": "superseded", "rank": 5}]


def test_a_member_that_never_posts_is_named_by_rank_0():
    channels = _channels(dist.HashStore(), 7, 3)
    _post_all(channels, skip=(4,))
    assert _forward_all(channels, timeout_s=0.2) == [True, False, True]  # its leader forwards nothing
    collected = channels[0].collect(KEY, 0.2)
    assert collected.missing == [4] and collected.unforwarded == []
    assert channels[0].missing(KEY) == [4] and channels[0].posted(KEY, 3) and not channels[0].posted(KEY, 4)
    assert channels[0].missing(KEY, 1) == [4] and channels[0].missing(KEY, 0) == []  # one group's, for its leader


def test_a_leader_that_never_forwards_is_named_by_rank_0():
    channels = _channels(dist.HashStore(), 7, 3)
    _post_all(channels)
    _forward_all(channels, but=(3,))
    collected = channels[0].collect(KEY, 0.2)
    assert collected.missing == [] and collected.unforwarded == [3]


@pytest.mark.parametrize("record", [b"[0,7,1]\x1f,\"a\":1", b"[0,7,1]\x1f,\"a\":1\x1f\x1f"], ids=["short", "long"])
def test_an_intact_record_framed_wrongly_by_its_rank_is_refused(record):
    """A record whose digest is right but whose rank framed it with too few or too many parts (a bug)."""
    store = dist.HashStore()
    channel = _channels(store, 1, None)[0]
    channel._post_record(store, channel._own(KEY), 0, record)
    with pytest.raises(ShareDamaged, match="does not have 3 parts"):
        channel.open_shares(channel.collect(KEY, 5.0), MANIFEST_SHARES)
