"""``OfflineWriter`` writes, from one process and one buffer, the checkpoint the engine writes.

* The same states saved by three ``CheckpointEngine`` ranks (one process, a shared store, the
  same run id) and by one ``OfflineWriter``: every file under the checkpoint directory is the same
  byte for byte (tensor files, sidecars, rank reports), and the manifests differ only in their
  commit time. States include a non-contiguous view, a tensor larger than the buffer, several
  dtypes, a rank with two files and one with a file of no tensors; the buffer is 4 KiB (chunk boundaries fall
  inside tensors), the engine's cache tiny.
* The result loads (``open_committed``, checksums verified) bit-exactly, passes ``verify``, and
  the save directory's lock names the run, as the engine's does.
* Refusals name what they refuse: an existing checkpoint directory, a rank outside the world, a
  file name saved twice, a save after commit; a write that fails names its file.
* On an ``s3://`` root (the session's real S3 server) it writes the same bytes as on a file system,
  object for file (its runs are multipart uploads), and the result verifies and loads from there;
  a checkpoint already under the prefix is refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError, object_store
from megatron_ext.engine.format.names import MANIFEST
from megatron_ext.engine.read.committed import open_committed
from megatron_ext.engine.read.verify import verify_checkpoint
from megatron_ext.engine.save.lifecycle.lock import LOCK_FILE
from megatron_ext.engine.save.offline_writer import OfflineWriter

from helpers.states import FAST, TINY, assert_same

RUN = "0123456789ab"
WORLD = 3


def _states() -> dict[int, list[tuple[str, dict, dict | None]]]:
    """rank -> [(file name, state, extra)]."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(300, 70, generator=g)  # 84 KB: many 4 KiB chunks
    return {
        0: [("rank00000", {"w": big[:, 3:40], "b": torch.arange(7, dtype=torch.int64), "meta": {"it": 7, "s": "x"}},
             {"objects": [], "layout": {"tp_rank": 0}}),
            ("extra0", {"h": torch.randn(5, 5, generator=g).to(torch.bfloat16)}, None)],
        1: [("rank00001", {"w": big, "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4)},
             {"objects": ["o@0"], "layout": {"tp_rank": 1}})],
        2: [("rank00002", {"note": "no tensors", "n": [1, 2.5, None]}, None)],
    }


def _with_engines(root: str) -> None:
    store = dist.HashStore()
    engines = [CheckpointEngine({"save_dir": root, **TINY, **FAST, "remove_partial_on_start": False}, rank=r,
                                world_size=WORLD, run_id=RUN, commit_store=store) for r in range(WORLD)]
    try:
        for rank, engine in enumerate(engines):
            for name, state, extra in _states().get(rank, []):
                engine.save(state, "iter_0000007", name, version=7, extra=extra)
            engine.commit("iter_0000007")
        for engine in engines:
            engine.wait_persisted(timeout=30)
    finally:
        for engine in engines:
            engine.shutdown(timeout=10)


def _with_writer(root: str) -> dict:
    with OfflineWriter({"chunk_size_mb": 0.004}, root, "iter_0000007", world_size=WORLD, version=7,
                       run_id=RUN) as writer:
        for rank, files in sorted(_states().items(), reverse=True):  # any order
            for name, state, extra in files:
                writer.save(rank, state, name, extra=extra)
        return writer.commit()


def _tree(root: str) -> dict[str, bytes]:
    found = {}
    for dirpath, _, names in os.walk(os.path.join(root, "iter_0000007")):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def test_the_writer_writes_what_the_engine_writes(tmp_path):
    engine_root, writer_root = str(tmp_path / "engine"), str(tmp_path / "writer")
    _with_engines(engine_root)
    header = _with_writer(writer_root)
    assert header["run_id"] == RUN and header["world_size"] == WORLD and header["version"] == 7

    by_engine, by_writer = _tree(engine_root), _tree(writer_root)
    assert sorted(by_writer) == sorted(by_engine)
    manifest = os.path.join("iter_0000007", MANIFEST)
    for rel in by_engine:
        if rel != manifest:
            assert by_writer[rel] == by_engine[rel], f"{rel} differs"
    ours, theirs = (json.loads(tree.pop(manifest)) for tree in (by_writer, by_engine))
    assert ours.pop("committed_at") and theirs.pop("committed_at")
    assert ours == theirs
    assert len(ours["files"]) == 4 and sorted(ours["reports"]) == ["0", "1", "2"]

    with open(os.path.join(writer_root, LOCK_FILE)) as f:
        assert json.load(f)["runs"] == [RUN]
    assert verify_checkpoint(writer_root, "iter_0000007", deep=True) == []
    committed = open_committed(writer_root, "iter_0000007")
    for rank, files in _states().items():
        for name, state, _ in files:
            assert_same(committed.reader(name).state(), state)


def test_refusals_name_what_they_refuse(tmp_path):
    root = str(tmp_path / "ckpt")
    with OfflineWriter(None, root, "iter_0000001", world_size=2, version=1) as writer:
        with pytest.raises(CheckpointError, match="outside world of size 2"):
            writer.save(2, {"w": torch.ones(2)})
        writer.save(0, {"w": torch.ones(2)}, "a")
        with pytest.raises(CheckpointError, match="already has a file named 'a' \\(rank 0's\\)"):
            writer.save(1, {"w": torch.ones(2)}, "a")
        writer.commit()
        with pytest.raises(CheckpointError, match="save\\(\\) after commit"):
            writer.save(1, {"w": torch.ones(2)}, "b")
    with pytest.raises(CheckpointError, match=f"{tmp_path}/ckpt/iter_0000001 exists"):
        OfflineWriter(None, root, "iter_0000001", world_size=2)
    committed = open_committed(root, "iter_0000001")
    assert [f.name for f in committed.files()] == ["a"]


def test_a_failed_write_names_its_file(tmp_path):
    root = tmp_path / "ckpt"
    with OfflineWriter(None, str(root), "iter_0000001", world_size=1, run_id=RUN) as writer:
        sidecar = root / "iter_0000001" / f"rank00000.{RUN}.state.json"
        sidecar.mkdir(parents=True)  # where the sidecar goes: a directory
        with pytest.raises(OSError) as failed:
            writer.save(0, {"w": torch.ones(3)})
        assert failed.value.filename == str(sidecar)


def test_on_an_object_store_it_writes_the_same_objects(tmp_path, s3_root):
    local = str(tmp_path / "local")
    _with_writer(local)
    header = _with_writer(s3_root)
    assert header["run_id"] == RUN and header["world_size"] == WORLD

    checkpoint = object_store.join(s3_root, "iter_0000007")
    stored = {name: object_store.get(object_store.join(checkpoint, name)) for name, _ in object_store.walk(checkpoint)}
    by_file = {os.path.relpath(rel, "iter_0000007"): data for rel, data in _tree(local).items()}
    assert sorted(stored) == sorted(by_file)
    for rel, data in by_file.items():
        if rel != MANIFEST:
            assert stored[rel] == data, f"{rel} differs"
    ours, theirs = json.loads(stored[MANIFEST]), json.loads(by_file[MANIFEST])
    assert ours.pop("committed_at") and theirs.pop("committed_at")
    assert ours == theirs

    assert verify_checkpoint(s3_root, "iter_0000007", deep=True) == []
    committed = open_committed(s3_root, "iter_0000007")
    for files in _states().values():
        for name, state, _ in files:
            assert_same(committed.reader(name).state(), state)
    with pytest.raises(CheckpointError, match=f"{s3_root}/iter_0000007 exists"):
        OfflineWriter(None, s3_root, "iter_0000007", world_size=WORLD)
