"""Write paths and retention: O_DIRECT on and off give identical files; keep_last/keep_every
remove old committed checkpoints only, on both levels."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.engine import read_manifest

from helpers.states import TINY, assert_same, clone_state, committed_names, seeded_state


def _state(i: int) -> dict:
    return seeded_state(i, 10_001, (33, 65), b=lambda g: torch.rand(77, generator=g) > 0.5)


@pytest.mark.parametrize("o_direct", [True, False, "auto"], ids=["direct", "buffered", "auto"])
def test_o_direct_modes_write_identical_bytes(make_engine, tmp_path, o_direct):
    engine = make_engine(**TINY, o_direct=o_direct)
    state = _state(5)
    expected = clone_state(state)
    engine.save(state, "c1", version=5)
    engine.commit("c1")
    engine.wait_persisted()
    assert_same(engine.load("c1"), expected)
    entry = read_manifest(str(tmp_path / "ckpt" / "c1"))["files"]["rank00000"]
    size = (tmp_path / "ckpt" / entry["tensor_file"]).stat().st_size
    assert size == entry["size"] and size % 4096 != 0  # O_DIRECT padding was cut off


def test_keep_last_and_keep_every(make_engine, tmp_path):
    local = tmp_path / "local"
    engine = make_engine(**TINY, keep_last=2, keep_every=3, local_dir=str(local))
    for step in range(1, 8):
        engine.save(_state(step), f"s{step}", version=step)
        engine.commit(f"s{step}")
        engine.wait_persisted()
    engine.shutdown()  # the deleter finishes its queue
    assert committed_names(tmp_path / "ckpt") == ["s3", "s6", "s7"]
    assert sorted(p.name for p in local.iterdir()) == [".datastates.lock", "s3", "s6", "s7"]
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".deleting")]
    reader = make_engine(**TINY, read_only=True)
    for step in (3, 6, 7):
        assert_same(reader.load(f"s{step}"), _state(step))


def test_retention_lists_without_reading_back_the_manifest_it_just_committed(make_engine, tmp_path, monkeypatch):
    from megatron_ext.engine.format import catalog as catalog_module

    engine = make_engine(**TINY, keep_last=1)
    reads = []
    real = catalog_module.read_manifest
    monkeypatch.setattr(catalog_module, "read_manifest", lambda path: reads.append(path) or real(path))
    for step in range(1, 4):
        engine.save(_state(step), f"s{step}", version=step)
        engine.commit(f"s{step}")
        engine.wait_persisted()
    engine.shutdown()
    # listing the root after each commit read no manifest: each was remembered when committed (the
    # deleter still re-reads the ones it removes, through retention's own import)
    assert reads == []
    assert committed_names(tmp_path / "ckpt") == ["s3"]
