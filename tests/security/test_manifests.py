"""Manifests are validated before any use; a bad or foreign one never blocks the directory.

One rule per case: each damaged manifest is refused by ``read_manifest`` (which every reader,
retention and replica recovery go through) with an error naming the file and the rule. Foreign or
unreadable manifests in sibling directories are skipped with a warning, later commits still work,
and retention touches only checkpoints of runs that held the directory's lock.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed, read_manifest

from helpers.hostile import (C1, C2, SMALL, files_of, genuine_state, manifest_path, name_of, read_json, report_path,
                             reseal, save_genuine, seal_report, write_json)


def _file(doc):
    return doc["files"]["rank00000"]


MUTATIONS = {
    "not_an_object": (lambda d: [d], "not a JSON object"),
    "another_format": (lambda d: d.update(format="safetensors.index"), "not a megatron_ext.datastates manifest"),
    "newer_version": (lambda d: d.update(format_version=4), "written by a newer format (version 4"),
    "version_as_text": (lambda d: d.update(format_version="1"), "format_version '1' is not a version number"),
    "bad_run_id": (lambda d: d.update(run_id="../x"), "run_id '../x' is not 12 hex digits"),
    "other_checkpoint": (lambda d: d.update(checkpoint=C1), f"belongs to checkpoint '{C1}', not to its directory"),
    "version_as_text_2": (lambda d: d.update(version="2"), "version '2' is not a whole number"),
    "world_size_zero": (lambda d: d.update(world_size=0), "world_size 0 is not a whole number >= 1"),
    "committed_at_text": (lambda d: d.update(committed_at="now"), "committed_at 'now' is not a time"),
    "files_a_list": (lambda d: d.update(files=[]), "files is not an object"),
    "hidden_file_name": (lambda d: d["files"].update({".x": dict(_file(d), name=".x")}), "file '.x': not a valid file name"),
    "entry_names_another": (lambda d: _file(d).update(name="rank00001"), "its entry is not an object naming it"),
    "rank_outside_world": (lambda d: _file(d).update(rank=3), "rank 3 is outside world size 1"),
    "rank_a_bool": (lambda d: _file(d).update(rank=False), "rank False is outside world size 1"),
    "negative_size": (lambda d: _file(d).update(size=-1), "size -1 is not a safetensors file size"),
    "state_size_text": (lambda d: _file(d).update(state_size="9"), "state_size '9' is not a size"),
    "bad_file_checksum": (lambda d: _file(d).update(xxh3_64="nothex"), "xxh3_64 'nothex' is not an xxh3-64 checksum"),
    "reports_missing": (lambda d: d.__delitem__("reports"), "reports is not an object"),
    "report_of_a_rank_too_many": (lambda d: d["reports"].update({"1": d["reports"]["0"]}), "exactly ranks 0..0"),
    "report_of_another_run": (lambda d: d["reports"]["0"].update(file=d["reports"]["0"]["file"].replace(
        d["run_id"], "0123456789ab")), "report of rank 0 is not an object naming"),
    "report_outside_the_checkpoint": (lambda d: d["reports"]["0"].update(file="../x.json"), "is not an object naming"),
    "report_size_text": (lambda d: d["reports"]["0"].update(size="9"), "size '9' is not a report size"),
    "report_checksum_bad": (lambda d: d["reports"]["0"].update(xxh3_64="nothex"), "is not an xxh3-64 checksum"),
    "inline_tensors_in_format_2": (lambda d: _file(d).update(tensors={}), "format 2 keeps in the rank's report"),
}


def _report_file(doc):
    return doc["files"][0]


def _report_tensor(doc, name="w"):
    return _report_file(doc)["tensors"][name]


#: Rules of a file's tensor index, which format 2 keeps in the rank report: each mutation is made to
#: the report, the manifest resealed to its new bytes, and the report must then be refused by that rule.
REPORT_MUTATIONS = {
    "tensors_a_list": (lambda d: _report_file(d).update(tensors=[]), "tensors is not an object"),
    "reserved_tensor_name": (lambda d: _report_file(d)["tensors"].update({"__metadata__": _report_tensor(d)}),
                             "'__metadata__' is reserved"),
    "unknown_dtype": (lambda d: _report_tensor(d).update(dtype="F99"), "unknown dtype 'F99'"),
    "negative_shape": (lambda d: _report_tensor(d).update(shape=[-1]), "shape [-1] is not a list of whole numbers"),
    "offsets_not_a_pair": (lambda d: _report_tensor(d).update(offsets=[4096]), "offsets [4096] are not [begin, end]"),
    "offsets_past_the_end": (lambda d: _report_tensor(d).update(offsets=[_report_file(d)["size"],
                                                                         _report_file(d)["size"] + 4000]),
                             "lie outside the file's"),
    "length_disagrees_with_shape": (lambda d: _report_tensor(d).update(shape=[999]),
                                    "bytes do not hold shape [999] of F32"),
    "overlapping_tensors": (lambda d: _report_tensor(d, "b").update(offsets=[_report_tensor(d)["offsets"][0],
                                                                            _report_tensor(d)["offsets"][0] + 168]),
                            "overlap"),
    "tensor_checksum_null": (lambda d: _report_tensor(d).update(xxh3_64=None), "xxh3_64 None is not a checksum"),
    "entry_disagrees_with_the_manifest": (lambda d: _report_file(d).update(size=_report_file(d)["size"] + 8),
                                          "its entry differs from the manifest's"),
    "another_rank": (lambda d: d.update(rank=1), "rank 1 is not the manifest's 0"),
    "another_run": (lambda d: d.update(run_id="0123456789ab"), "run_id '0123456789ab' is not the manifest's"),
    "another_checkpoint": (lambda d: d.update(checkpoint=C1), f"checkpoint '{C1}' is not the manifest's"),
    "newer_format": (lambda d: d.update(format_version=4), "format_version 4 is not one this reader knows"),
    "a_file_missing": (lambda d: d.update(files=[]), "lacks files ['rank00000']"),
    "a_file_the_manifest_lacks": (lambda d: d["files"].append(dict(_report_file(d), name="rank00009")),
                                  "lists file 'rank00009', which the manifest does not list"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_rule_of_the_manifest(genuine, mutation):
    change, message = MUTATIONS[mutation]
    doc = read_json(manifest_path(genuine, C2))
    replaced = change(doc)
    write_json(manifest_path(genuine, C2), replaced if replaced is not None else doc)
    with pytest.raises(CheckpointError, match=re.escape(f"{manifest_path(genuine, C2)}: ") + ".*" + re.escape(message)):
        read_manifest(str(genuine / C2))
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            engine.load(C2, "rank00000")
        assert engine.latest() == C1  # skipped, not fatal


@pytest.mark.parametrize("mutation", sorted(REPORT_MUTATIONS))
def test_each_rule_of_the_rank_report(genuine, mutation):
    """The same rules as format 1's inline index, plus the report's tie to the manifest; the error names the report."""
    change, message = REPORT_MUTATIONS[mutation]
    report = report_path(genuine, C2)
    doc = read_json(report)
    change(doc)
    write_json(report, doc)
    seal_report(genuine, C2)
    assert read_manifest(str(genuine / C2)) is not None  # the manifest itself is intact
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=re.escape(f"{report}: ") + ".*" + re.escape(message)):
            engine.load(C2, "rank00000")
        assert engine.load(C1, "rank00000")["step"] == 1


@pytest.mark.parametrize("raw, message", [
    (b'{"format": "megatron_ext.datastates", "format": "x"}', "duplicate key 'format'"),
    (b'{"committed_at": NaN}', "NaN is not JSON"),
    (b'\xff\xfe{}', "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"format": ', "not valid JSON"),
])
def test_manifest_json_is_strict(genuine, raw, message):
    manifest_path(genuine, C2).write_bytes(raw)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_manifest(str(genuine / C2))


def test_foreign_and_damaged_manifests_are_skipped_and_commits_go_on(genuine, caplog):
    (genuine / "hf_export").mkdir()
    (genuine / "hf_export" / "manifest.json").write_text(json.dumps({"weight_map": {}}))
    shutil.copytree(genuine / C1, genuine / "backup_of_1")  # a user's cp -r: names C1 inside
    damaged = genuine / name_of(0)
    shutil.copytree(genuine / C1, damaged)
    manifest_path(genuine, name_of(0)).write_text('{"format": "megatron_ext.datastates", "files": {')
    with caplog.at_level(logging.WARNING, logger="megatron_ext.engine"):
        assert [n for n, _ in list_committed(str(genuine))] == [C1, C2]
    assert {"hf_export", "backup_of_1", name_of(0)} <= {r.getMessage().split("/")[-2] for r in caplog.records
                                                        if "skipping" in r.getMessage()}
    with CheckpointEngine({"save_dir": str(genuine), **SMALL, "keep_last": 1}) as engine:
        assert engine.latest() == C2
        for i in (3, 4):
            engine.save(genuine_state(i), name_of(i), version=i)
            engine.commit(name_of(i))
            engine.wait_persisted()
    # Retention removed the older checkpoints of this directory's runs only; nobody else's directory.
    left = sorted(p.name for p in genuine.iterdir() if not p.name.startswith("."))
    assert left == sorted(["backup_of_1", "hf_export", name_of(0), name_of(4), "datastates_telemetry"])


def test_retention_never_removes_a_checkpoint_of_a_run_that_did_not_hold_the_lock(tmp_path):
    """A checkpoint brought in from another save directory (its run never wrote here) is left alone."""
    elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
    save_genuine(elsewhere, [1])
    save_genuine(here, [2])
    shutil.copytree(elsewhere / C1, here / C1)  # valid where it lies: same name, another run
    with CheckpointEngine({"save_dir": str(here), **SMALL, "keep_last": 1}) as engine:
        for i in (3, 4):
            engine.save(genuine_state(i), name_of(i), version=i)
            engine.commit(name_of(i))
            engine.wait_persisted()
    assert [n for n, _ in list_committed(str(here))] == [C1, name_of(4)]


def test_a_tensor_the_sidecar_names_but_the_manifest_lacks_is_an_error(genuine):
    """``load_into`` used to keep the template's values silently for such a tensor."""
    tensor_file, _ = files_of(genuine, C2)
    data = tensor_file.read_bytes()
    assert data.count(b'"w":') == 1
    tensor_file.write_bytes(data.replace(b'"w":', b'"v":'))  # header and manifest call it "v"; the sidecar "w"
    doc = read_json(report_path(genuine, C2))  # the tensor index (format 2: the rank report)
    _report_file(doc)["tensors"]["v"] = _report_file(doc)["tensors"].pop("w")
    write_json(report_path(genuine, C2), doc)
    reseal(genuine, C2)
    template = copy.deepcopy(genuine_state(9))
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=r"refers to tensor 'w', which the manifest does not list"):
            engine.load_into(C2, template, "rank00000")
        with pytest.raises(CheckpointError, match=r"refers to tensor 'w', which the manifest does not list"):
            engine.load(C2, "rank00000")
        assert torch.equal(template["w"], genuine_state(9)["w"])
        loaded = engine.load_into(C1, template, "rank00000")
        assert torch.equal(loaded["w"], genuine_state(1)["w"]) and loaded["w"].data_ptr() == template["w"].data_ptr()
