"""A commit counts only once rank 0 validated the manifest it writes, exactly as a loader will; what
retention keeps and what ``latest()`` picks follow the versions.

Two in-process ranks share one commit store. A share of the manifest that rank 1 posts is damaged
on its way (a bug, a bit flip in the store, a rank of another job): the checkpoint fails on both
ranks with an error naming rank 1, no manifest is written, and ``keep_last=1`` deletes nothing, so
the previous checkpoint still loads. A rank report that would not load fails the same way.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError, ConfigError, list_committed
from megatron_ext.engine.format import report as report_module
from megatron_ext.engine.save.commit import committer as commit_module

from helpers.hostile import C1, C2, SMALL, genuine_state, name_of

RUN = "0123456789ab"


def _two_ranks(root, **config) -> list[CheckpointEngine]:
    store = dist.HashStore()
    return [CheckpointEngine({"save_dir": str(root), **SMALL, **config}, rank=r, world_size=2, run_id=RUN,
                             commit_store=store) for r in range(2)]


def _save_both(engines, checkpoint: str, version: int) -> None:
    for rank, engine in enumerate(engines):
        engine.save(genuine_state(version * 10 + rank), checkpoint, f"rank{rank:05d}", version=version)
        engine.commit(checkpoint)


def _shutdown(engines) -> None:
    for engine in engines:
        try:
            engine.shutdown()
        except CheckpointError:
            pass  # the engine stopped on the failure the test provoked


def _escaping_path(files: bytes) -> bytes:
    """Well-formed, but its tensor file lies outside the checkpoint."""
    return re.sub(rb'"tensor_file":"[^"]*"', b'"tensor_file":"../../etc/passwd"', files)


def _malformed(files: bytes) -> bytes:
    return files[:len(files) // 2]


def _claims_another_rank(files: bytes) -> bytes:
    """Rank 1's entry says rank 0 wrote the file (a report naming another rank's file)."""
    return files.replace(b'"rank":1', b'"rank":0')


def _absurd_size(files: bytes) -> bytes:
    return re.sub(rb'"state_size":\d+', b'"state_size":1000000000000', files)


def _second_checkpoint_fails_on_both_ranks(root, damage_from_now_on, error: str) -> None:
    """C1 commits; ``damage_from_now_on()``; C2 must fail on both ranks with ``error``, leaving C1
    the newest committed checkpoint, intact (``keep_last=1`` would have deleted it after a commit)."""
    engines = _two_ranks(root, keep_last=1)
    try:
        _save_both(engines, C1, 1)
        for engine in engines:
            engine.wait_persisted()
        damage_from_now_on()
        _save_both(engines, C2, 2)
        for engine in engines:
            with pytest.raises(CheckpointError, match=error):
                engine.wait_persisted()
    finally:
        _shutdown(engines)
    assert not (root / C2 / "manifest.json").exists()
    assert [name for name, _ in list_committed(str(root))] == [C1]  # retention removed nothing
    with CheckpointEngine({"save_dir": str(root), **SMALL}, read_only=True) as reader:
        assert reader.latest() == C1
        for rank in range(2):
            assert torch.equal(reader.load(C1, f"rank{rank:05d}")["w"], genuine_state(10 + rank)["w"])


@pytest.mark.parametrize("damage", [_escaping_path, _malformed, _claims_another_rank, _absurd_size],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_bad_share_fails_the_checkpoint_on_every_rank_and_deletes_nothing(tmp_path, monkeypatch, damage):
    real = report_module.manifest_part  # what each rank's durable share is made with

    def damaged(summary):
        head, shares = real(summary)
        if summary["rank"] == 1:
            shares = dict(shares, files=damage(shares["files"]))
        return head, shares

    _second_checkpoint_fails_on_both_ranks(tmp_path / "ckpt", lambda: monkeypatch.setattr(
        report_module, "manifest_part", damaged), rf"checkpoint {C2}.*rank 1")


def test_a_rank_report_that_would_not_load_fails_its_commit(tmp_path, monkeypatch):
    """Each rank holds its own report (the tensor index rank 0 never reads) to the loader's rules."""
    real = commit_module.job_report

    def past_the_end(job, rank, world_size):
        report = real(job, rank, world_size)
        if rank == 1:
            entry = report["files"][0]
            entry["tensors"]["w"]["offsets"] = [entry["size"], entry["size"] + 4000]
        return report

    _second_checkpoint_fails_on_both_ranks(tmp_path / "ckpt", lambda: monkeypatch.setattr(
        commit_module, "job_report", past_the_end), rf"checkpoint {C2}.*rank 1.*lie outside the file")


def test_an_unversioned_checkpoint_is_never_the_newest(tmp_path):
    """``save(s, "final_export")`` before versioned steps: ``latest()`` is the highest version, and
    retention keeps it and the named export (retention counts the versioned series only)."""
    root = tmp_path / "ckpt"
    with CheckpointEngine({"save_dir": str(root), **SMALL, "keep_last": 1}) as engine:
        engine.save(genuine_state(9), "final_export")
        engine.commit("final_export")
        engine.wait_persisted()
        assert engine.latest() == "final_export"  # the only one: newest by commit time
        for step in range(4):
            engine.save(genuine_state(step), name_of(step), version=step)
            engine.commit(name_of(step))
            engine.wait_persisted()
            assert engine.latest() == name_of(step)
        assert torch.equal(engine.load(engine.latest())["w"], genuine_state(3)["w"])
    assert [name for name, _ in list_committed(str(root))] == ["final_export", name_of(3)]


def test_unversioned_checkpoints_order_by_commit_time_before_versioned_ones(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointEngine({"save_dir": str(root), **SMALL}) as engine:
        for name, version in (("b", None), (name_of(5), 5), ("a", None), (name_of(2), 2)):
            engine.save(genuine_state(1), name, version=version)
            engine.commit(name)
            engine.wait_persisted()
        assert [name for name, _ in list_committed(str(root))] == ["b", "a", name_of(2), name_of(5)]
        assert engine.latest() == name_of(5)


@pytest.mark.parametrize("keep_last", [0, -1, "2", 1.5, True])
def test_commit_validates_keep_last_at_the_call(tmp_path, keep_last):
    root = tmp_path / "ckpt"
    with CheckpointEngine({"save_dir": str(root), **SMALL}) as engine:
        engine.save(genuine_state(1), C1, version=1)
        with pytest.raises(ConfigError, match=re.escape(f"keep_last must be a whole number >= 1, got {keep_last!r}")):
            engine.commit(C1, keep_last=keep_last)
        engine.commit(C1, keep_last=1)  # the engine is unharmed
        engine.save(genuine_state(2), C2, version=2)
        engine.commit(C2, keep_last=1)
        engine.wait_persisted()
    assert [name for name, _ in list_committed(str(root))] == [C2]
