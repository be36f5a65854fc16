"""Rank 0 commits a manifest without parsing it: each rank holds its own share to the loader's rules
before posting (``manifest.check_share``), and rank 0 holds every share to the seeded xxh3-64 its
rank posted (``CommitChannel.open_shares``). These tests damage shares *after* their rank checked
them, in the commit store, where only the digest can see it: a format-valid change (a checksum
digit), a truncation, a share posted twice, a stranger's share claiming a rank. Each fails the
checkpoint on every rank, naming the rank, writes no manifest and deletes nothing.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed, read_manifest
from megatron_ext.engine.format.manifest import (
    MANIFEST_SHARES,
    assemble_manifest,
    check_share,
    encode_json,
    manifest_part,
    summarize_heads,
)
from megatron_ext.engine.format.validation import validate_manifest
from megatron_ext.engine.save.commit import coordination
from megatron_ext.engine.save.commit.coordination import RECORD, CommitChannel, ShareDamaged

from helpers.hostile import C1, C2, SMALL, genuine_state

RUN = "0123456789ab"


# ---------------------------------------------------------------------------- two engines, damage in the store
class _DamagingStore:
    """The committer's store, with what rank 1 appends to a share key passed through ``damage``
    (a list of the byte strings to append instead). Keys of either protocol contain ``share``."""

    def __init__(self, store, damage):
        self.store, self.damage = store, damage

    def append(self, key, value):
        for part in (self.damage(value) if "share" in key else [value]):
            self.store.append(key, part)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _checksum_digit(value: bytes) -> list[bytes]:
    """Still a well-formed share: one hex digit of a checksum changed (no format rule can see it)."""
    return [re.sub(rb'("xxh3_64":")(.)', lambda m: m.group(1) + (b"1" if m.group(2) != b"1" else b"2"), value,
                   count=1)]


def _truncated(value: bytes) -> list[bytes]:
    return [value[:-7]] if len(value) > 7 else [value]


def _twice(value: bytes) -> list[bytes]:
    return [value, value]


def _stranger(value: bytes) -> list[bytes]:
    """Rank 1's share, then a stranger's copy of it saying other things (another job on a reused port)."""
    return [value, *_checksum_digit(value)] if value else [value]


def _save_both(engines, checkpoint: str, version: int) -> None:
    for rank, engine in enumerate(engines):
        engine.save(genuine_state(version * 10 + rank), checkpoint, f"rank{rank:05d}", version=version)
        engine.commit(checkpoint)


@pytest.mark.parametrize("damage", [_checksum_digit, _truncated, _twice, _stranger],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_share_damaged_in_the_store_fails_the_checkpoint_naming_its_rank(tmp_path, monkeypatch, damage):
    root = tmp_path / "ckpt"
    store = dist.HashStore()
    engines = [CheckpointEngine({"save_dir": str(root), **SMALL, "keep_last": 1}, rank=r, world_size=2, run_id=RUN,
                                commit_store=store) for r in range(2)]
    try:
        _save_both(engines, C1, 1)
        for engine in engines:
            engine.wait_persisted()
        real = CommitChannel.post_durable

        def post_durable(self, key, head, shares):
            if self.rank != 1:
                return real(self, key, head, shares)
            waiting = self.waiting
            self.waiting = _DamagingStore(waiting, damage)
            try:
                return real(self, key, head, shares)
            finally:
                self.waiting = waiting

        monkeypatch.setattr(CommitChannel, "post_durable", post_durable)
        _save_both(engines, C2, 2)
        for engine in engines:
            with pytest.raises(CheckpointError, match=rf"checkpoint {C2}.*rank 1"):
                engine.wait_persisted()
    finally:
        for engine in engines:
            try:
                engine.shutdown()
            except CheckpointError:
                pass
    assert not (root / C2 / "manifest.json").exists()
    assert [name for name, _ in list_committed(str(root))] == [C1]  # retention removed nothing
    with CheckpointEngine({"save_dir": str(root), **SMALL}, read_only=True) as reader:
        assert reader.latest() == C1
        assert torch.equal(reader.load(C1, "rank00001")["w"], genuine_state(11)["w"])


# ---------------------------------------------------------------------------- the channel alone
CKPT, WORLD = "iter_0000007", 6


def _share(rank: int, names: tuple[str, ...] = None, checkpoint: str = CKPT, run_id: str = RUN):
    """A rank's (head, shares), as ``manifest_part`` makes them from its report's summary."""
    names = (f"rank{rank:05d}",) if names is None else names
    summary = {"rank": rank, "version": 7,
               "report": {"file": f"{checkpoint}/.reports/rank-{rank:05d}.{run_id}.json", "size": 300 + rank,
                          "xxh3_64": f"{rank:016x}"},
               "files": [{"name": n, "tensor_file": f"{checkpoint}/{n}.{run_id}.safetensors",
                          "state_file": f"{checkpoint}/{n}.{run_id}.state.json", "size": 4096, "state_size": 10,
                          "xxh3_64": "0" * 16, "state_xxh3_64": "f" * 16, "extra": {"note": "\u00e9\u2028\x01"}}
                         for n in names]}
    return manifest_part(summary)


def _posted(world: int = WORLD, damage=None, key: str = "k/c/t"):
    """Every rank posts through one store; ``damage(blob)`` then rewrites ``shares`` in place."""
    store = dist.HashStore()
    for rank in range(world):
        head, shares = _share(rank)
        check_share(CKPT, RUN, rank, world, head, shares)
        CommitChannel(store, store, rank, world).post_durable(key, head, shares)
    if damage is not None:
        store.set(f"{key}/shares", damage(store.get(f"{key}/shares")))
    channel = CommitChannel(store, store, 0, world)
    return channel, channel.collect(key, 5.0), key


def test_intact_shares_join_into_a_manifest_the_loader_accepts():
    channel, collected, key = _posted()
    assert collected.missing == [] and len(collected.durable) == WORLD
    heads, shares = channel.open_shares(collected, MANIFEST_SHARES)
    assert [head[0] for head in heads] == list(range(WORLD))
    _, data = assemble_manifest(CKPT, RUN, 7, WORLD, summarize_heads(CKPT, heads, range(WORLD)), shares)
    doc = validate_manifest(json.loads(data), CKPT, "manifest")
    assert sorted(doc["files"]) == [f"rank{r:05d}" for r in range(WORLD)]
    assert doc["files"]["rank00003"]["extra"] == {"note": "\u00e9\u2028\x01"}


def test_every_single_byte_changed_in_a_record_names_its_rank():
    """Whatever byte of rank 3's record changes (its inner framing bytes included), rank 0 names rank
    3; the byte that opens it also closes rank 2's record, and then both are named."""
    _, clean, _ = _posted()
    start = clean.records.index(b'\x1e[3,')
    end = clean.records.index(RECORD, start + 1)
    assert clean.records[start - 1:start] != b"" and start > 0  # rank 2's record comes first
    for pos in range(start, end):
        channel, collected, key = _posted(damage=lambda blob: blob[:pos] + bytes([blob[pos] ^ 0x01]) + blob[pos + 1:])
        with pytest.raises(ShareDamaged, match=r"rank 2's share.*ranks \[3\]" if pos == start else r"rank 3's share"):
            channel.open_shares(collected, MANIFEST_SHARES)


def test_a_record_checked_for_another_world_size_or_attempt_is_refused():
    store = dist.HashStore()
    key = "k/c/t"
    for rank in range(3):
        head, shares = _share(rank)
        world = 4 if rank == 2 else 3  # rank 2 digested its record for another job shape
        CommitChannel(store, store, rank, world).post_durable(key, head, shares)
    channel = CommitChannel(store, store, 0, 3)
    with pytest.raises(ShareDamaged, match="rank 2's share") as caught:
        channel.open_shares(channel.collect(key, 5.0), MANIFEST_SHARES)
    assert caught.value.rank == 2


def test_bytes_before_the_first_record_are_refused():
    channel, collected, key = _posted(damage=lambda blob: b"{}" + blob)
    with pytest.raises(ShareDamaged):
        channel.open_shares(collected, MANIFEST_SHARES)


# ---------------------------------------------------------------------------- what each rank checks of its own share
def _refused(head, shares, rank: int = 1, message: str = ""):
    with pytest.raises(CheckpointError, match=rf"checkpoint {CKPT}: rank {rank}'s share of the manifest would not "
                                              rf"load: .*{message}"):
        check_share(CKPT, RUN, rank, WORLD, head, shares)


def test_a_rank_refuses_a_share_the_loader_would_refuse():
    head, shares = _share(1)
    check_share(CKPT, RUN, 1, WORLD, head, shares)
    files = shares["files"]
    _refused(head, dict(shares, files=files[:-1]), message="not valid JSON")
    _refused(head, dict(shares, files=files.replace(b'"size":4096', b'"size":4096,"size":4096')),
             message="duplicate key")
    _refused(head, dict(shares, files=files.replace(b'"size":4096', b'"size":NaN')), message="not JSON")
    _refused(head, dict(shares, files=files.replace(b'"rank":1', b'"rank":0')), message="says rank 0")
    _refused(head, dict(shares, files=files.replace(b'"rank":1', b'"rank":6')), message="outside world size")
    _refused(head, dict(shares, files=files.replace(b'"state_size":10', b'"state_size":1099511627776')),
             message="state_size")
    _refused(head, dict(shares, files=files.replace(f"{CKPT}/rank00001.{RUN}.safetensors".encode(),
                                                    b"../../etc/passwd")), message="tensor_file")
    _refused(head, dict(shares, files=files.replace(f"rank00001.{RUN}.state.json".encode(), b"other.state.json")),
             message="are not")  # inside the checkpoint, but not the path the writer makes: could collide
    _refused(head, dict(shares, files=files + files), message="duplicate key")
    _refused(head, dict(shares, files=files + b"\x1e"), message="comma-led")
    _refused(head, dict(shares, files=b","), message="lone comma")
    _refused([7, 10, "rank00009"], shares, message="are not the ones its head names")
    _refused(head, dict(shares, reports=shares["reports"].replace(b'"1":', b'"2":')), message="not exactly its own")
    _refused(head, dict(shares, reports=shares["reports"].replace(b"rank-00001", b"rank-00002")),
             message="report of rank 1")
    _refused(["7", 10, "rank00001"], shares, message="version")


def test_a_rank_without_files_posts_an_empty_share_and_the_manifest_still_loads():
    store, key = dist.HashStore(), "k/c/t"
    for rank in range(3):
        head, shares = _share(rank, names=() if rank == 1 else None)
        check_share(CKPT, RUN, rank, 3, head, shares)
        CommitChannel(store, store, rank, 3).post_durable(key, head, shares)
    channel = CommitChannel(store, store, 0, 3)
    heads, shares = channel.open_shares(channel.collect(key, 5.0), MANIFEST_SHARES)
    _, data = assemble_manifest(CKPT, RUN, 7, 3, summarize_heads(CKPT, heads, range(3)), shares)
    doc = validate_manifest(json.loads(data), CKPT, "manifest")
    assert sorted(doc["files"]) == ["rank00000", "rank00002"] and sorted(doc["reports"]) == ["0", "1", "2"]


def test_duplicate_names_across_ranks_fail_naming_both_ranks():
    store, key = dist.HashStore(), "k/c/t"
    for rank in range(3):
        head, shares = _share(rank, names=("shared",) if rank in (0, 2) else None)
        CommitChannel(store, store, rank, 3).post_durable(key, head, shares)
    channel = CommitChannel(store, store, 0, 3)
    heads, shares = channel.open_shares(channel.collect(key, 5.0), MANIFEST_SHARES)
    with pytest.raises(CheckpointError, match="file name 'shared' saved by ranks 0 and 2"):
        assemble_manifest(CKPT, RUN, 7, 3, summarize_heads(CKPT, heads, range(3)), shares)


def test_the_commit_writes_what_read_manifest_accepts(tmp_path):
    """End to end through two engines: the manifest rank 0 joined without parsing is read back."""
    root = tmp_path / "ckpt"
    store = dist.HashStore()
    engines = [CheckpointEngine({"save_dir": str(root), **SMALL}, rank=r, world_size=2, run_id=RUN,
                                commit_store=store) for r in range(2)]
    try:
        _save_both(engines, C1, 1)
        for engine in engines:
            engine.wait_persisted()
    finally:
        for engine in engines:
            engine.shutdown()
    manifest = read_manifest(str(root / C1))
    assert sorted(manifest["files"]) == ["rank00000", "rank00001"] and sorted(manifest["reports"]) == ["0", "1"]
    assert encode_json(manifest)  # a plain document
