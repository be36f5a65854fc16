"""Every number a checkpoint holds is bounded before use, by the one validation layer ``load``,
``verify``, ``inspect``, ``export`` and ``convert`` share.

Sizes too large to allocate or to index, shapes whose dimensions do not fit an int64, shard
metadata of a Megatron checkpoint that lacks a key, lies about its global shape or places a box
outside it, and sidecars of millions of JSON values: each is one ``CheckpointError`` naming the
file (one line from the command-line tools), never ``OverflowError``, ``MemoryError``, torch's
``TypeError`` or an allocator's error, and ``verify`` refuses exactly what ``load`` and ``export``
refuse.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from megatron_ext.engine import CheckpointEngine, CheckpointError
from megatron_ext.engine.format import catalog
from megatron_ext.engine.format import sidecar as sidecar_module
from megatron_ext.engine.read.inspect import describe
from megatron_ext.engine.read.verify import verify_checkpoint

from helpers.hostile import (
    C1,
    C2,
    SHARD_ID,
    SMALL,
    assert_one_line_error,
    cli_in_process,
    files_of,
    genuine_state,
    manifest_path,
    read_json,
    report_path,
    reseal,
    rewrite_sidecar,
    save_megatron_like,
    seal_report,
    write_json,
)

INT64_MAX = (1 << 63) - 1


# ------------------------------------------------------------------------------ sizes
def _manifest_report_size(size):
    def change(root: Path) -> str:
        doc = read_json(manifest_path(root, C2))
        doc["reports"]["0"]["size"] = size
        write_json(manifest_path(root, C2), doc)
        return "size"
    return change


def _report_one_mb_too_long(root: Path) -> str:
    doc = read_json(manifest_path(root, C2))
    doc["reports"]["0"]["size"] += 1 << 20
    write_json(manifest_path(root, C2), doc)
    return "the manifest says"


def _file_number(key, value):
    """The same number in the manifest's entry and the rank report's (which must agree), report resealed."""
    def change(root: Path) -> str:
        doc = read_json(manifest_path(root, C2))
        doc["files"]["rank00000"][key] = value
        report = read_json(report_path(root, C2))
        report["files"][0][key] = value
        write_json(report_path(root, C2), report)
        seal_report(root, C2, 0, doc)
        write_json(manifest_path(root, C2), doc)
        return key if key != "size" else "bytes"
    return change


#: attack -> (tamper, whether it is in what is read before any data file: the manifest or a rank
#: report, which ``inspect`` reads and ``export`` and ``convert`` read first)
SIZES = {
    "report_size_int64": (_manifest_report_size(INT64_MAX), True),
    "report_size_terabyte": (_manifest_report_size(10 ** 12), True),
    "report_longer_than_its_file": (_report_one_mb_too_long, True),
    "state_size_int64": (_file_number("state_size", INT64_MAX), True),
    "state_size_terabyte": (_file_number("state_size", 10 ** 12), True),
    "tensor_file_size_int64": (_file_number("size", INT64_MAX), False),
}


@pytest.mark.parametrize("attack", sorted(SIZES))
def test_absurd_sizes_are_one_clear_error_everywhere(genuine, tmp_path, capsys, attack):
    tamper, up_front = SIZES[attack]
    needle = tamper(genuine)
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=re.escape(needle)) as info:
            engine.load(C2, "rank00000")
        assert f"{genuine}/{C2}/" in str(info.value)  # names the file
        assert torch.equal(engine.load(C1, "rank00000")["w"], genuine_state(1)["w"])
    problems = verify_checkpoint(str(genuine), C2)
    assert problems and needle in str(problems[0])
    rows = {row["checkpoint"]: row for row in describe(str(genuine))}
    assert "error" not in rows[C1]
    if up_front:
        assert needle in rows[C2]["error"]
    for command in (["export", str(genuine), "--iteration", "2", "--to", "safetensors", str(tmp_path / "out")],
                    ["convert", str(genuine), "--iteration", "2", "--to", "torch_dist", str(tmp_path / "conv")]):
        line = assert_one_line_error(cli_in_process(capsys, *command), *([needle] if up_front else []))
        assert f"{C2}/" in line and "cannot fit" not in line and "Error" not in line


def test_a_manifest_claiming_more_ranks_than_it_lists_is_refused_without_counting_them(genuine):
    doc = read_json(manifest_path(genuine, C2))
    doc["world_size"] = 10 ** 6
    write_json(manifest_path(genuine, C2), doc)
    with pytest.raises(CheckpointError, match="reports must list exactly ranks"):
        catalog.read_manifest(str(genuine / C2))


# ------------------------------------------------------------------------------ shapes
def _add_empty_tensor(root: Path, shape: list[int]) -> None:
    """A zero-element tensor ``z`` of ``shape`` in the tensor file's header and in the tensor index."""
    tensor_file, _ = files_of(root, C2)
    data = tensor_file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    end = max(info["data_offsets"][1] for name, info in header.items() if name != "__metadata__")
    header["z"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}
    body = json.dumps(header).encode()
    assert len(body) <= n
    tensor_file.write_bytes(data[:8] + body + b" " * (n - len(body)) + data[8 + n:])
    report = read_json(report_path(root, C2))
    entry = report["files"][0]
    entry["tensors"]["z"] = {"dtype": "F32", "shape": shape, "offsets": [8 + n + end] * 2,
                             "xxh3_64": xxhash.xxh3_64_hexdigest(b"")}
    write_json(report_path(root, C2), report)
    reseal(root, C2)


@pytest.mark.parametrize("shape", [[0, 1 << 63], [0, 1 << 62, 4], [0, INT64_MAX]], ids=str)
def test_a_zero_element_tensor_with_an_absurd_dimension_is_refused_by_verify_and_load(genuine, shape):
    _add_empty_tensor(genuine, shape)
    problems = verify_checkpoint(str(genuine), C2)
    assert problems and "does not fit an int64" in str(problems[0])
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match="does not fit an int64"):
            engine.load(C2, "rank00000")


def test_a_zero_element_tensor_of_sane_shape_still_loads(genuine):
    _add_empty_tensor(genuine, [0, 3])
    assert verify_checkpoint(str(genuine), C2) == []
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        assert engine.load(C2, "rank00000")["w"].shape == (1000,)


# ------------------------------------------------------------------------------ JSON volume
def test_a_sidecar_of_millions_of_values_is_refused_before_it_is_parsed(genuine):
    rewrite_sidecar(genuine, C2, lambda state: state.update(names=[0] * 4_300_000))
    problems = verify_checkpoint(str(genuine), C2)
    assert problems and "JSON values" in str(problems[0]) and "state.json" in problems[0].path
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=r"state\.json: .*JSON values"):
            engine.load(C2, "rank00000")


def test_save_refuses_a_sidecar_the_loader_would_refuse(tmp_path, monkeypatch):
    monkeypatch.setattr(sidecar_module, "SIDECAR_VALUES", 1000)
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **SMALL}) as engine:
        with pytest.raises(CheckpointError, match="JSON values"):
            engine.save({"w": torch.ones(2), "indices": list(range(5000))}, C1, version=1)
        engine.save({"w": torch.ones(2), "indices": list(range(500))}, C1, version=1)
        engine.commit(C1)
        engine.wait_persisted()
        assert engine.load(C1)["indices"] == list(range(500))


# ------------------------------------------------------------------------------ Megatron shard metadata
def _shard_meta(change):
    def apply(state):
        change(state["shards"]["meta"][SHARD_ID])
    return apply


SHARD_ATTACKS = {
    "no_key": (lambda m: m.pop("key"), "has no key"),
    "key_not_text": (lambda m: m.update(key=7), "key 7"),
    "huge_global_shape": (lambda m: m.update(global_shape=[10 ** 6, 10 ** 6]), "cover"),
    "offset_outside": (lambda m: m.update(global_offset=[-4, 2 ** 63]), "global_offset"),
    "dimension_beyond_int64": (lambda m: m.update(global_shape=[4, 2 ** 64], local_shape=[4, 2 ** 64]),
                               "fit an int64"),
    "box_outside_the_global_shape": (lambda m: m.update(global_offset=[2, 0]), "outside the global shape"),
    "local_shape_of_other_size": (lambda m: m.update(local_shape=[2, 6], global_shape=[4, 6]),
                                  "holds 24 elements"),
    "dtype_not_a_dtype": (lambda m: m.update(dtype="Tensor"), "dtype 'Tensor'"),
    "dtype_other_than_saved": (lambda m: m.update(dtype="bfloat16"), "saved as float32"),
    "flat_range_beyond_the_box": (lambda m: m.update(flattened_range=[0, 10 ** 12]), "flattened_range"),
    "prepended_axes_negative": (lambda m: m.update(prepend_axis_num=-1), "prepend_axis_num"),
    "meta_not_an_object": (lambda m: m.clear() or m.update({"0": 1}), "has no key"),
}


@pytest.fixture(scope="module")
def megatron_pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron") / "ckpt"
    save_megatron_like(root)
    return root


@pytest.fixture
def megatron_root(tmp_path, megatron_pristine) -> Path:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(megatron_pristine, root)
    return root


def test_the_megatron_shaped_checkpoint_exports_and_verifies(megatron_root, tmp_path, capsys):
    ok = cli_in_process(capsys, "verify", str(megatron_root))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    out = cli_in_process(capsys, "export", str(megatron_root), "--iteration", "2", "--to", "safetensors",
                         str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    exported = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    assert torch.equal(exported["decoder.weight"], torch.arange(24, dtype=torch.float32).reshape(4, 6))


@pytest.mark.parametrize("attack", sorted(SHARD_ATTACKS))
def test_shard_metadata_is_bounded_before_use(megatron_root, tmp_path, capsys, attack):
    change, needle = SHARD_ATTACKS[attack]
    rewrite_sidecar(megatron_root, C2, _shard_meta(change))
    sidecar = files_of(megatron_root, C2)[1].name
    verify = cli_in_process(capsys, "verify", str(megatron_root))
    assert verify.returncode == 1 and needle in verify.stdout and sidecar in verify.stdout, verify.stdout + verify.stderr
    for command in (["export", str(megatron_root), "--iteration", "2", "--to", "safetensors", str(tmp_path / "out")],
                    ["convert", str(megatron_root), "--iteration", "2", "--to", "torch_dist", str(tmp_path / "conv")]):
        line = assert_one_line_error(cli_in_process(capsys, *command), needle, sidecar)
        assert "Error:" not in line.split("error:", 1)[1], line  # no raw exception type
