"""Manifest format 2: the manifest lists each rank's report (its tensor index) by size and checksum,
so its size does not grow with the number of tensors; format 1 checkpoints (tensors inline) still
load, verify and inspect; a tampered report is one ``CheckpointError`` naming the report."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import xxhash

from megatron_ext.engine import CheckpointError, read_manifest
from megatron_ext.engine.format.manifest import TensorIndex, encode_json
from megatron_ext.engine.format.validation import validate_manifest
from megatron_ext.engine.format.version import FORMAT_VERSION
from megatron_ext.engine.read.inspect import describe
from megatron_ext.engine.read.verify import verify_checkpoint

from helpers.manifests import build_manifest, file_tensors, summarize_report
from helpers.states import TINY, assert_same


def _state(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer{i:04d}": torch.randn(3, 5, generator=g) for i in range(n)}
    state.update(bf=torch.randn(17, generator=g).to(torch.bfloat16), ints=torch.arange(9, dtype=torch.int64),
                 empty=torch.zeros(0), step=seed)
    return state


def _save(make_engine, state: dict, checkpoint: str = "c1", **config):
    engine = make_engine(**TINY, **config)
    engine.save_and_commit(state, checkpoint, "f", version=1)
    engine.wait_persisted()
    return engine


def _report(root, checkpoint="c1", rank=0):
    return root / json.loads((root / checkpoint / "manifest.json").read_bytes())["reports"][str(rank)]["file"]


def _to_v1(ckpt_dir) -> None:
    """Rewrite a manifest as format 1 wrote it: each file's tensors inline, no reports, each tensor
    file's digest of its bytes (format 3 makes it of its pieces', test_file_digest.py)."""
    path = ckpt_dir / "manifest.json"
    doc = json.loads(path.read_bytes())
    del doc["reports"]
    index = {}
    for entry in doc["files"].values():
        if entry["rank"] not in index:
            name = f"rank-{entry['rank']:05d}.{doc['run_id']}.json"
            index[entry["rank"]] = {e["name"]: e["tensors"] for e in
                                    json.loads((ckpt_dir / ".reports" / name).read_bytes())["files"]}
        entry["tensors"] = index[entry["rank"]][entry["name"]]
        entry["xxh3_64"] = xxhash.xxh3_64_hexdigest((ckpt_dir.parent / entry["tensor_file"]).read_bytes())
    doc["format_version"] = 1
    path.write_text(json.dumps(doc))


# ---------------------------------------------------------------------------- the format
def test_manifest_lists_reports_not_tensors_and_does_not_grow_with_them(make_engine, tmp_path):
    engine = _save(make_engine, _state(10), "small")
    engine.save_and_commit(_state(200), "large", "f", version=1)
    engine.wait_persisted()
    root = tmp_path / "ckpt"
    sizes = {}
    for checkpoint, tensors in (("small", 13), ("large", 203)):
        manifest = read_manifest(str(root / checkpoint))
        assert manifest["format_version"] == FORMAT_VERSION == 3
        assert all("tensors" not in entry for entry in manifest["files"].values())
        report = _report(root, checkpoint).read_bytes()
        assert manifest["reports"] == {"0": {"file": f"{checkpoint}/.reports/rank-00000.{manifest['run_id']}.json",
                                             "size": len(report), "xxh3_64": xxhash.xxh3_64_hexdigest(report)}}
        assert len(file_tensors(str(root / checkpoint), manifest, "f")) == tensors
        sizes[checkpoint] = ((root / checkpoint / "manifest.json").stat().st_size, len(report))
    # 20x the tensors: the manifest differs by a few digits (sizes, checksums, the time), the report grows.
    assert abs(sizes["large"][0] - sizes["small"][0]) <= 16, sizes
    assert sizes["large"][1] > 10 * sizes["small"][1], sizes


def test_summaries_build_the_manifest_the_commit_writes(make_engine, tmp_path):
    _save(make_engine, _state(4))
    root = tmp_path / "ckpt"
    manifest = read_manifest(str(root / "c1"))
    rel = manifest["reports"]["0"]["file"]
    summary = summarize_report(_report(root).read_bytes(), rel)
    built = build_manifest("c1", manifest["run_id"], 1, 1, [summary])
    assert {k: v for k, v in built.items() if k != "committed_at"} == \
        {k: v for k, v in manifest.items() if k != "committed_at"}
    assert validate_manifest(json.loads(json.dumps(built)), "c1", "built") == built


def _summary(rank, names, version=1):
    return {"rank": rank, "version": version,
            "report": {"file": f"c1/.reports/rank-{rank:05d}.0123456789ab.json", "size": 100, "xxh3_64": "0" * 16},
            "files": [{"name": n, "tensor_file": f"c1/{n}.s", "state_file": f"c1/{n}.j", "size": 8, "state_size": 0,
                       "xxh3_64": "0" * 16, "state_xxh3_64": "0" * 16} for n in names]}


def test_build_manifest_refuses_duplicate_names_and_version_disagreement():
    with pytest.raises(CheckpointError, match="file name 'a' saved by ranks 0 and 1; names must be unique"):
        build_manifest("c1", "0123456789ab", 1, 2, [_summary(0, ["a"]), _summary(1, ["b", "a"])])
    with pytest.raises(CheckpointError, match=r"ranks disagree on the version \['1', '2'\]"):
        build_manifest("c1", "0123456789ab", 1, 2, [_summary(0, ["a"]), _summary(1, ["b"], version=2)])
    with pytest.raises(CheckpointError, match="summary 0 is of rank 1"):
        build_manifest("c1", "0123456789ab", 1, 2, [_summary(1, ["a"]), _summary(0, ["b"])])
    doc = build_manifest("c1", "0123456789ab", 1, 2, [_summary(0, ["a"]), _summary(1, ["b"])],
                         attempt_of="ba9876543210")
    assert validate_manifest(doc, "c1", "m") is doc
    assert doc["files"]["b"]["rank"] == 1 and sorted(doc["reports"]) == ["0", "1"]
    assert doc["attempt_of"] == "ba9876543210" and "tensors" not in doc["files"]["a"]


def test_a_rank_that_saved_nothing_states_no_version():
    """DeepSpeed without ZeRO: data-parallel ranks other than 0 save nothing and only join the commit."""
    doc = build_manifest("c1", "0123456789ab", 3, 2, [_summary(0, ["a"], version=3), _summary(1, [], version=None)])
    assert doc["version"] == 3 and sorted(doc["files"]) == ["a"] and sorted(doc["reports"]) == ["0", "1"]
    doc = build_manifest("c1", "0123456789ab", None, 2, [_summary(0, [], version=None), _summary(1, ["b"], version=3)])
    assert doc["version"] == 3  # rank 0 saved nothing: the savers' version


# ---------------------------------------------------------------------------- format 1
def test_a_format_1_checkpoint_still_loads_verifies_and_inspects(make_engine, tmp_path):
    state = _state(12, seed=3)
    engine = _save(make_engine, state)
    root = tmp_path / "ckpt"
    _to_v1(root / "c1")
    for report in (root / "c1" / ".reports").iterdir():
        report.unlink()  # format 1 never read them: the index is inline
    manifest = read_manifest(str(root / "c1"))
    assert manifest["format_version"] == 1 and len(manifest["files"]["f"]["tensors"]) == 15
    assert_same(engine.load("c1", "f"), state)
    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    assert_same(engine.load_into("c1", template, "f"), state)
    assert verify_checkpoint(str(root), "c1") == []
    (row,) = describe(str(root), only="c1")
    assert row["committed"] and row["tensors"] == 15 and "error" not in row
    # Its inline index is held to the same rules as ever.
    doc = json.loads((root / "c1" / "manifest.json").read_bytes())
    doc["files"]["f"]["tensors"]["ints"]["offsets"][1] += 8
    (root / "c1" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="manifest.json: file 'f': tensor 'ints'"):
        read_manifest(str(root / "c1"))


# ---------------------------------------------------------------------------- tampered reports
def _shift_offsets(doc):
    meta = doc["files"][0]["tensors"]["ints"]
    meta["offsets"] = [meta["offsets"][0] + 8, meta["offsets"][1] + 8]


def _swap_checksums(doc):
    tensors = doc["files"][0]["tensors"]
    tensors["ints"]["xxh3_64"], tensors["bf"]["xxh3_64"] = tensors["bf"]["xxh3_64"], tensors["ints"]["xxh3_64"]


CHANGED = r"(checksum mismatch \(xxh3-64\): the bytes changed|has \d+ bytes, the manifest says \d+)"


@pytest.mark.parametrize("tamper, message", [
    ("offsets", CHANGED),
    ("checksums", r"checksum mismatch \(xxh3-64\): the bytes changed"),
    ("symlink", "a symbolic link"),
    ("missing", "missing"),
    ("another_run", CHANGED),
    ("another_run_resealed", "run_id '[0-9a-f]{12}' is not the manifest's"),
    ("grown", r"has \d+ bytes, the manifest says \d+"),
])
def test_a_tampered_report_is_one_error_naming_it(make_engine, tmp_path, tamper, message):
    state = _state(6)
    engine = _save(make_engine, state)
    root = tmp_path / "ckpt"
    report = _report(root)
    doc = json.loads(report.read_bytes())
    if tamper in ("offsets", "checksums"):
        (_shift_offsets if tamper == "offsets" else _swap_checksums)(doc)
        report.write_bytes(encode_json(doc))  # as the engine writes it
    elif tamper == "symlink":
        shutil.copy(report, tmp_path / "copy.json")  # the same, valid bytes, reached through a link
        report.unlink()
        report.symlink_to(tmp_path / "copy.json")
    elif tamper == "missing":
        report.unlink()
    elif tamper == "grown":
        report.write_bytes(report.read_bytes() + b" ")
    else:  # the same checkpoint saved by another run, its report put in place of this one's
        other = make_engine(**TINY, save_dir=str(tmp_path / "other"))
        other.save_and_commit(state, "c1", "f", version=1)
        other.wait_persisted()
        shutil.copy(_report(tmp_path / "other"), report)
        if tamper == "another_run_resealed":  # and the manifest's size and checksum made to match it
            manifest = json.loads((root / "c1" / "manifest.json").read_bytes())
            data = report.read_bytes()
            manifest["reports"]["0"].update(size=len(data), xxh3_64=xxhash.xxh3_64_hexdigest(data))
            (root / "c1" / "manifest.json").write_text(json.dumps(manifest))
    pattern = "^" + re.escape(f"{report}: ") + ".*" + message
    with pytest.raises(CheckpointError, match=pattern):
        engine.load("c1", "f")
    with pytest.raises(CheckpointError, match=pattern):
        file_tensors(str(root / "c1"), read_manifest(str(root / "c1")), "f")
    problems = verify_checkpoint(str(root), "c1")
    assert [p.path for p in problems] == [f"c1/.reports/{report.name}"] and re.search(message, problems[0].what)
    (row,) = describe(str(root), only="c1")
    assert row["tensors"] is None and str(report) in row["error"]


def test_each_report_is_read_once_per_index(make_engine, tmp_path):
    _save(make_engine, _state(3))
    root = tmp_path / "ckpt"
    index = TensorIndex(str(root / "c1"), read_manifest(str(root / "c1")))
    first = index.tensors("f")
    _report(root).unlink()  # a second read would fail
    assert index.tensors("f") is first
    with pytest.raises(CheckpointError, match="has no file 'g'"):
        index.tensors("g")
    assert os.path.exists(root / "c1" / "manifest.json")
