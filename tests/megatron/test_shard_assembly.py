"""SavedShards: any box of a global tensor from shards saved in another layout (real engine files)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

from megatron_ext.engine import CheckpointEngine, CheckpointError  # noqa: E402
from megatron_ext.engine.read.file_reader import FileReader  # noqa: E402
from megatron_ext.megatron import sharding  # noqa: E402
from megatron_ext.megatron.shard_assembly import SavedShards  # noqa: E402

LAYERS, ROWS, COLS = 2, 6, 4
# Global tensors: a stacked per-layer weight (one prepended layer axis), its optimizer twin
# (saved as flat slices), a 1-D bf16 bias and a scalar.
WEIGHT = torch.arange(LAYERS * ROWS * COLS, dtype=torch.float32).view(LAYERS, ROWS, COLS)
BIAS = (torch.arange(8, dtype=torch.float32) / 3).to(torch.bfloat16)
SCALAR = torch.tensor(7.5, dtype=torch.float64)


def _box(key: str, data: torch.Tensor, layer: int, row: int, rows: int) -> ShardedTensor:
    """Layer ``layer``'s rows ``row:row+rows`` of the stacked weight (TP-split along the rows)."""
    return ShardedTensor(key, data, data.dtype, (rows, COLS), (LAYERS, ROWS, COLS), (layer, row, 0),
                         None, prepend_axis_num=1)


def _saved_layout() -> dict[str, list]:
    """Shards as three ranks of a 'TP=2' layout would own them (a file per rank)."""
    files: dict[str, list] = {"rank00000": [], "rank00001": [], "rank00002": []}
    for layer, half in itertools.product(range(LAYERS), range(2)):
        rows = slice(half * 3, half * 3 + 3)
        files[f"rank0000{half}"].append(_box("w", WEIGHT[layer, rows].clone(), layer, rows.start, 3))
        # The optimizer twin: the box's flat elements split unevenly over three data-parallel ranks.
        flat = (WEIGHT[layer, rows] * 10).reshape(-1)
        model = _box("w", WEIGHT[layer, rows], layer, rows.start, 3)
        for dp, (start, stop) in enumerate([(0, 5), (5, 9), (9, 12)]):
            files[f"rank0000{dp}"].append(sharding.flat_shard(model, "opt.w", flat[start:stop].clone(),
                                                              slice(start, stop), (0, 0, 0)))
    for half in range(2):
        data = BIAS[half * 4:half * 4 + 4].clone()
        whole = ShardedTensor("b", data, data.dtype, (4,), (8,), (half * 4,), None)
        for dp, (start, stop) in enumerate([(0, 1), (1, 4)]):
            files[f"rank0000{dp + 1}"].append(sharding.flat_shard(whole, "b", data[start:stop].clone(),
                                                                  slice(start, stop), (0, 0, 0)))
    files["rank00002"].append(ShardedTensor("s", SCALAR.clone(), SCALAR.dtype, (), (), (), None))
    scalar = ShardedTensor("s.flat", SCALAR.clone(), SCALAR.dtype, (), (), (), None)  # a 0-dim param's slice
    files["rank00001"].append(sharding.flat_shard(scalar, "s.flat", SCALAR.reshape(1).clone(), slice(0, 1), (0, 0, 0)))
    return files


def _write(root: Path, files: dict[str, list]) -> None:
    with CheckpointEngine({"save_dir": str(root), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        for name, shards in files.items():
            tensors = {sharding.shard_id(s): s.data for s in shards}
            meta = {sharding.shard_id(s): sharding.shard_meta(s) for s in shards}
            engine.save({"shards": {"tensors": tensors, "objects": {}, "meta": meta}}, "iter_0000001", name,
                        version=1)
        engine.commit("iter_0000001")
        engine.wait_persisted()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> SavedShards:
    root = tmp_path_factory.mktemp("shards")
    _write(root, _saved_layout())
    engine = CheckpointEngine({"save_dir": str(root), "host_cache_size": 0.001}, rank=0, world_size=1)
    try:
        yield SavedShards(engine.open_checkpoint("iter_0000001"))
    finally:
        engine.shutdown()


EXPECTED = {"w": WEIGHT, "opt.w": WEIGHT * 10, "b": BIAS, "s": SCALAR, "s.flat": SCALAR}


def test_describes_every_key(saved: SavedShards):
    assert saved.keys() == sorted(EXPECTED)
    for key, tensor in EXPECTED.items():
        assert saved.global_shape(key) == tuple(tensor.shape)
        assert saved.dtype(key) == tensor.dtype


def test_read_global_joins_dense_boxes_and_flat_slices(saved: SavedShards):
    for key, tensor in EXPECTED.items():
        got = saved.read_global(key)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key


def test_read_box_matches_slicing_for_random_boxes(saved: SavedShards):
    rng = random.Random(0)
    for key in ("w", "opt.w", "b"):
        full = EXPECTED[key]
        for _ in range(60):
            offset = [rng.randrange(n) for n in full.shape]
            shape = [rng.randint(1, n - o) for n, o in zip(full.shape, offset)]
            expected = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            assert torch.equal(saved.read_box(key, offset, shape), expected), (key, offset, shape)


def test_read_shard_in_another_layout(saved: SavedShards):
    """'TP=3' boxes of the stacked weight, and 'DP=2' flat slices of them, as a new layout asks."""
    for layer, third in itertools.product(range(LAYERS), range(3)):
        offset, local = (layer, third * 2, 0), (2, COLS)
        box = WEIGHT[layer, third * 2:third * 2 + 2]
        assert torch.equal(saved.read_shard("w", offset, local, prepend_axis_num=1), box)
        for start, stop in [(0, 3), (3, 8), (5, 6), (0, 8)]:
            got = saved.read_shard("opt.w", offset, local, 1, slice(start, stop))
            assert torch.equal(got, (box * 10).reshape(-1)[start:stop]), (layer, third, start, stop)
    assert torch.equal(saved.read_shard("b", (2,), (6,), 0, (1, 5)), BIAS[2:8][1:5])
    assert saved.read_shard("s", (), ()).item() == SCALAR.item()
    assert torch.equal(saved.read_shard("s.flat", (), (), 0, slice(0, 1)), SCALAR.reshape(1))


def test_reads_only_the_overlapping_tensors(saved: SavedShards, monkeypatch):
    reads: list[str] = []
    original = FileReader.tensor

    def counting(self, name):
        reads.append(name)
        return original(self, name)

    monkeypatch.setattr(FileReader, "tensor", counting)
    saved.read_box("w", (1, 0, 0), (1, 2, COLS))  # layer 1, first TP half only
    assert len(reads) == 1
    reads.clear()
    # Reads go by whole rows: row 0 (flat 0:4) lies inside the first data-parallel slice (0:5) ...
    saved.read_shard("opt.w", (0, 3, 0), (3, COLS), 1, slice(1, 3))
    assert len(reads) == 1
    reads.clear()
    # ... row 2 (flat 8:12) needs the last two (5:9, 9:12).
    saved.read_shard("opt.w", (0, 3, 0), (3, COLS), 1, slice(10, 12))
    assert len(reads) == 2


def test_clear_errors(saved: SavedShards, tmp_path: Path):
    with pytest.raises(CheckpointError, match="no tensor 'missing'"):
        saved.read_global("missing")
    with pytest.raises(CheckpointError, match="outside the global shape"):
        saved.read_box("w", (0, 4, 0), (1, 3, COLS))
    with pytest.raises(CheckpointError, match="outside the box"):
        saved.read_shard("b", (0,), (4,), 0, (2, 5))
    # Drop one data-parallel slice: boxes that need it fail, the others still read.
    files = _saved_layout()
    files["rank00001"] = [s for s in files["rank00001"] if not (s.key == "opt.w" and s.global_offset[0] == 1)]
    _write(tmp_path, files)
    with CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        partial = SavedShards(engine.open_checkpoint("iter_0000001"))
        assert torch.equal(partial.read_box("opt.w", (0, 0, 0), (1, ROWS, COLS)), WEIGHT[:1] * 10)
        with pytest.raises(CheckpointError, match="do not cover"):
            partial.read_global("opt.w")
