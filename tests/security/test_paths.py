"""Manifest entries cannot lead a reader outside their checkpoint, or to another checkpoint's files.

Outside the save directory lies a *valid* copy of a tensor file and sidecar (``secret.*``), so a
reader that followed an escaping path would succeed silently: every attack must instead be
refused by ``load``, ``verify``, ``inspect``, ``export`` and ``convert`` with a clear error, and
the audit hook must show that nothing outside the attacked checkpoint was opened.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed

from helpers.hostile import (C1, C2, SMALL, assert_one_line_error, cli_in_process, files_of, genuine_state,
                             manifest_path, read_json, report_path, reseal, seal_report, write_json)


def _plant_secret(tmp_path: Path, root: Path) -> tuple[Path, Path]:
    """Valid files of C1 outside the save directory."""
    tensor, state = files_of(root, C1)
    secret_t, secret_s = tmp_path / "secret.safetensors", tmp_path / "secret.state.json"
    shutil.copy(tensor, secret_t)
    shutil.copy(state, secret_s)
    return secret_t, secret_s


def _entry(root: Path) -> tuple[dict, dict]:
    doc = read_json(manifest_path(root, C2))
    return doc, doc["files"]["rank00000"]


def _point(root: Path, tensor_file: str, state_file: str | None = None) -> None:
    doc, entry = _entry(root)
    entry["tensor_file"] = tensor_file
    if state_file is not None:
        entry["state_file"] = state_file
    write_json(manifest_path(root, C2), doc)
    reseal(root, C2)


def escape_relative(root: Path, tmp_path: Path) -> str:
    _point(root, "../secret.safetensors", "../secret.state.json")
    return "tensor_file '../secret.safetensors' is not <checkpoint>/<file name>"


def escape_through_checkpoint(root: Path, tmp_path: Path) -> str:
    _point(root, f"{C2}/../../secret.safetensors", f"{C2}/../../secret.state.json")
    return "is not <checkpoint>/<file name>"


def escape_absolute(root: Path, tmp_path: Path) -> str:
    _point(root, str(tmp_path / "secret.safetensors"), str(tmp_path / "secret.state.json"))
    return "is not <checkpoint>/<file name>"


def other_checkpoints_files(root: Path, tmp_path: Path) -> str:
    """Step 2's manifest naming step 1's files: load(step 2) would return step 1's tensors."""
    entry1 = read_json(manifest_path(root, C1))["files"]["rank00000"]
    _point(root, entry1["tensor_file"], entry1["state_file"])
    return f"is not <checkpoint>/<file name> inside {C2}"


def duplicated_entry(root: Path, tmp_path: Path) -> str:
    doc, entry = _entry(root)
    doc["files"]["rank00001"] = dict(entry, name="rank00001")
    doc["world_size"] = 2
    doc["files"]["rank00001"]["rank"] = 1
    rank1 = os.path.basename(doc["reports"]["0"]["file"]).replace("rank-00000", "rank-00001")
    doc["reports"]["1"] = dict(doc["reports"]["0"], file=f"{C2}/.reports/{rank1}")  # a well-formed report entry
    write_json(manifest_path(root, C2), doc)
    return "is listed twice"


def symlinked_tensor_file(root: Path, tmp_path: Path) -> str:
    tensor, state = files_of(root, C2)
    tensor.unlink()
    tensor.symlink_to(tmp_path / "secret.safetensors")
    doc, entry = _entry(root)
    secret = read_json(report_path(root, C1))["files"][0]
    entry.update({k: secret[k] for k in ("size", "xxh3_64")})  # the secret's own, valid values
    report = read_json(report_path(root, C2))
    report["files"][0].update({k: secret[k] for k in ("size", "xxh3_64", "tensors")})  # its index too
    write_json(report_path(root, C2), report)
    seal_report(root, C2, 0, doc)
    write_json(manifest_path(root, C2), doc)
    return "a symbolic link"


def fifo_sidecar(root: Path, tmp_path: Path) -> str:
    _, state = files_of(root, C2)
    state.unlink()
    os.mkfifo(state)  # opening it for reading would block forever without O_NONBLOCK
    return "not a regular file"


def symlinked_manifest(root: Path, tmp_path: Path) -> str:
    path = manifest_path(root, C2)
    path.unlink()
    shutil.copy(manifest_path(root, C1), tmp_path / "secret-manifest.json")
    path.symlink_to(tmp_path / "secret-manifest.json")
    return "manifest.json: a symbolic link"


ATTACKS = [escape_relative, escape_through_checkpoint, escape_absolute, other_checkpoints_files, duplicated_entry,
           symlinked_tensor_file, fifo_sidecar, symlinked_manifest]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__)
def test_load_refuses_and_reads_nothing_outside(genuine, tmp_path, audit, attack):
    secret_t, secret_s = _plant_secret(tmp_path, genuine)
    message = attack(genuine, tmp_path)
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with audit.watch():
            with pytest.raises(CheckpointError, match=re.escape(message)):
                engine.load(C2, "rank00000")
        audit.assert_confined(genuine / C2, tmp_path)
        assert not any(p.startswith(str(tmp_path / "secret")) for p in audit.opened())
        assert torch.equal(engine.load(C1, "rank00000")["w"], genuine_state(1)["w"])  # the previous one loads
    assert secret_t.read_bytes() and secret_s.read_bytes()


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda f: f.__name__)
def test_cli_commands_refuse_with_one_line(genuine, tmp_path, capsys, attack):
    _plant_secret(tmp_path, genuine)
    message = attack(genuine, tmp_path)
    cli = lambda *args: cli_in_process(capsys, *args)  # noqa: E731
    verify = cli("verify", str(genuine), "--checkpoint", C2)
    assert verify.returncode == 1 and message in verify.stdout and f"first bad file: {C2}/" in verify.stdout, verify.stdout
    assert "Traceback" not in verify.stderr
    one = cli("verify", str(genuine / C2))  # the checkpoint's own directory
    assert one.returncode == 1 and message in one.stdout
    assert cli("verify", str(genuine / C1)).returncode == 0
    inspect = cli("inspect", str(genuine))
    assert inspect.returncode == 0 and "Traceback" not in inspect.stderr
    if attack not in (symlinked_tensor_file, fifo_sidecar):  # the manifest itself is what is wrong
        assert f"{C2}" in inspect.stdout and "unreadable" in inspect.stdout
    for command in (["export", str(genuine), "--iteration", "2", "--to", "safetensors", str(tmp_path / "out")],
                    ["convert", str(genuine), "--iteration", "2", "--to", "torch_dist", str(tmp_path / "conv")]):
        if attack in (symlinked_tensor_file, fifo_sidecar):
            continue  # these need a Megatron checkpoint's content to get as far as the files
        assert_one_line_error(cli(*command), message.split(" '")[0])


def test_a_copied_checkpoint_is_not_taken_for_its_original(genuine, caplog):
    """``cp -r iter_2 backup``: its manifest names iter_2, so it is foreign where it lies; skipped, not loaded."""
    shutil.copytree(genuine / C2, genuine / "backup")
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match="belongs to checkpoint 'iter_0000002', not to its directory 'backup'"):
            engine.load("backup", "rank00000")
        assert engine.latest() == C2
    assert [name for name, _ in list_committed(str(genuine))] == [C1, C2]
    assert "skipping" in caplog.text and "backup" in caplog.text
