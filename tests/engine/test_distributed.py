"""Four gloo ranks under torchrun: each saves its own files, all commit, rank 0 writes one
manifest listing every rank's files, and every rank loads bit-exact."""

from __future__ import annotations

import json
import subprocess

from pathlib import Path

import pytest

from megatron_ext.engine import CheckpointEngine, read_manifest

from helpers.procs import REPO, child_env, torchrun_command
from helpers.states import FAST, TINY, assert_same, rank_state

HERE = Path(__file__).resolve().parent


WORLD = 4


@pytest.mark.multiproc
def test_four_gloo_ranks_save_commit_and_load(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    cmd = torchrun_command(WORLD, str(HERE / "_dist_worker.py"), str(root), str(out))
    proc = subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-6000:]
    outcomes = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]

    run_ids = {o["run_id"] for o in outcomes}
    assert len(run_ids) == 1  # rank 0 drew it, every rank received it
    expected_files = sorted(f"{p}_r{r}" for r in range(WORLD) for p in ("model", "optim"))
    for o in outcomes:
        assert o["world"] == WORLD
        assert o["latest"] == "iter_0000010"
        assert o["manifest_run_id"] in run_ids
        assert o["callback_files"] == expected_files  # on_committed ran on every rank
        assert o["checks"] and all(o["checks"].values()), o

    manifest = read_manifest(str(root / "iter_0000010"))
    assert manifest["world_size"] == WORLD and manifest["version"] == 10
    assert sorted(manifest["files"]) == expected_files
    for name, entry in manifest["files"].items():
        assert entry["rank"] == int(name.rsplit("_r", 1)[1])
        assert (root / entry["tensor_file"]).stat().st_size == entry["size"]
        assert (root / entry["state_file"]).stat().st_size == entry["state_size"]
    reports = sorted(p.name for p in (root / "iter_0000010" / ".reports").iterdir())
    assert reports == [f"rank-{r:05d}.{manifest['run_id']}.json" for r in range(WORLD)]

    # A fresh single-process reader sees every rank's files bit-exact.
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as reader:
        for r in range(WORLD):
            for part in ("model", "optim"):
                assert_same(reader.load("iter_0000010", f"{part}_r{r}"), rank_state(r, part))
    # Telemetry: one file per rank; the commit line only on rank 0.
    for r in range(WORLD):
        lines = [json.loads(line) for line in
                 (root / "datastates_telemetry" / f"rank-{r:05d}.jsonl").read_text().splitlines()]
        events = sorted((rec["event"], rec["level"]) for rec in lines)
        want = [("flush", "shared"), ("snapshot", "host")] + ([("commit", "all")] if r == 0 else [])
        assert events == sorted(want), (r, events)
