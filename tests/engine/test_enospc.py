"""A file system filled by a save, for real: a small tmpfs in a private mount namespace.

The save that fills it fails on the training thread; the restarted job must come up, remove that
save's partial files (never a committed checkpoint), and load the newest committed checkpoint;
when the file system is still full, the refusal says how much a save needs against what is free.
Without user and mount namespaces (``unshare -rm``) the test skips: an injected ENOSPC would not
show what the kernel's does to the restart's own probe.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers.procs import TESTS, child_env
from megatron_ext.engine.save.lifecycle.retention import remove_partial

WORKER = TESTS / "engine" / "_enospc_worker.py"


def _namespaces_or_skip(tmp_path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user and mount namespace: {probe.stderr.strip()}")


def test_restart_after_a_save_filled_the_disk_frees_its_partials_and_loads(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    _namespaces_or_skip(mount)
    python, worker = sys.executable, str(WORKER)
    script = (f"mount -t tmpfs -o size=3m tmpfs {mount} || exit 90; "
              f"{python} {worker} fill {mount}; echo \"fill-rc=$?\"; "
              f"{python} {worker} restart {mount} || exit 91; "
              f"{python} {worker} ballast {mount} || exit 92")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=child_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    filled, restarted, refused = lines
    assert "fill-rc=3" in proc.stdout  # the save's ENOSPC reached the training thread
    assert "No space left on device" in filled["error"] and "the checkpoint needs 4004161 bytes" in filled["error"]
    # The restart came up, removed B's partial files (2.7 MB of the 3 MiB) and kept A.
    assert restarted["latest"] == "A" and restarted["freed"] > 2_000_000
    assert restarted["left"] == [".datastates.lock", "A", "datastates_telemetry"]
    assert "removed 1 uncommitted save(s) left by a crash or skipped" in proc.stderr and ": B" in proc.stderr
    # Full of something else: refused, with what a save needs and what is free.
    assert "is full: 0 bytes (0.0 MiB) free" in refused["refused"]
    assert "the newest committed checkpoint, A, takes 404161 bytes" in refused["refused"]


def test_partials_without_reports_and_unlisted_files_of_committed_ones(tmp_path, make_engine):
    """A crash before ``.reports`` exists leaves only data files: removed if a run of the lock wrote
    them; a committed checkpoint keeps its manifest's files and loses the others."""
    root = tmp_path / "ckpt"
    engine = make_engine(save_dir=str(root))
    state = {"w": torch.arange(1000.0)}
    engine.save(state, "A", version=1)
    engine.commit("A")
    engine.wait_persisted()
    run = engine.run_id
    engine.shutdown()
    (root / "B").mkdir()
    (root / "B" / f"rank00000.{run}.safetensors").write_bytes(b"x" * 5000)
    (root / "C").mkdir()  # not ours: another run's files
    (root / "C" / "rank00000.0123456789ab.safetensors").write_bytes(b"x" * 10)
    (root / "D").mkdir()  # not only data files: left alone
    (root / "D" / f"rank00000.{run}.safetensors").write_bytes(b"x")
    (root / "D" / "notes.txt").write_text("mine")
    (root / "A" / "rank00001.fedcba987654.safetensors").write_bytes(b"y" * 3000)  # a crashed later save of A
    removed, freed = remove_partial(str(root), {run})
    assert removed == ["B"] and freed == 8000
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["A", "C", "D",
                                                                                     "datastates_telemetry"]
    with make_engine(save_dir=str(root), read_only=True) as reader:
        assert reader.latest() == "A"
        assert torch.equal(reader.load("A")["w"], state["w"])
