"""The object-store level against a real S3 server (SeaweedFS, started once per test run): saves,
commits, retention, loads, verify and inspect on ``s3://`` roots; four gloo ranks; the server
killed mid-upload; refusals at start-up; a stalled server under ``supersede``; the fetch scratch
of readers that were killed removed by the next reader."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, faults, object_store
from megatron_ext.engine.errors import CheckpointError, ConfigError
from megatron_ext.engine.format.catalog import list_committed
from megatron_ext.engine.read import object_fetch
from megatron_ext.engine.read.inspect import describe
from megatron_ext.engine.read.verify import verify_root

from helpers.procs import REPO, child_env, torchrun_command
from helpers.states import FAST, assert_same, rank_state

HERE = Path(__file__).resolve().parent


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(700, 1000, generator=g),  # 2.8 MB: parts of a multipart upload and a small rest
        "half": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 48, generator=g).t(),  # not contiguous
        "ids": torch.arange(step, step + 1000, dtype=torch.int64),
        "none": torch.empty(0),
        "step": step, "lr": 1e-3 * step, "name": f"run-{step}",
    }


def objects(root: str) -> list[str]:
    return sorted(name for name, _ in object_store.walk(root))


def uploads(root: str) -> list:
    u = object_store.ObjectUrl.parse(root)
    return object_store.client().list_multipart_uploads(Bucket=u.bucket, Prefix=u.prefix).get("Uploads", [])


def killer(server, checkpoint: str):
    """A fault hook that SIGKILLs ``server`` right before the second run of ``checkpoint``'s tensor
    file is uploaded (its first run's parts are up: an upload the server then holds incomplete);
    returns the offsets of the runs it saw and the hook."""
    runs: list[int] = []

    def hook(level, path, offset, nbytes):
        if checkpoint in path and path.endswith(".safetensors"):
            runs.append(offset)
            if len(runs) == 2:
                server.kill()

    return runs, hook


def test_checkpoints_round_trip_through_an_object_store(s3_root):
    config = {"save_dir": s3_root, "host_cache_size": 0.004, "chunk_size_mb": 1, "keep_last": 2, **FAST}
    with CheckpointEngine(config) as engine:
        for step in (1, 2, 3):
            engine.save(state(step), f"iter_{step:07d}", version=step)
            engine.wait_snapshot()
            engine.commit(f"iter_{step:07d}")
        engine.wait_persisted()
        assert engine.latest() == "iter_0000003"
        assert_same(engine.load("iter_0000003"), state(3))
    names = objects(s3_root)
    assert not any(n.startswith("iter_0000001/") for n in names), names  # retention deleted its objects
    assert "iter_0000002/manifest.json" in names and "iter_0000003/manifest.json" in names
    assert not uploads(s3_root)  # every upload completed

    # A restart leaves committed checkpoints whole (its start-up clean-up removes only crashes' leftovers).
    with CheckpointEngine(config) as engine:
        assert engine.latest() == "iter_0000003"
        assert_same(engine.load("iter_0000002"), state(2))
    assert objects(s3_root) == names

    checked, problems = verify_root(s3_root)
    assert checked == ["iter_0000002", "iter_0000003"] and problems == []
    rows = {r["checkpoint"]: r for r in describe(s3_root)}
    assert sorted(rows) == ["iter_0000002", "iter_0000003"]
    assert rows["iter_0000003"]["committed"] and rows["iter_0000003"]["version"] == 3
    assert rows["iter_0000003"]["bytes_on_disk"] >= rows["iter_0000003"]["bytes"] > 2_800_000


def test_a_damaged_object_is_named_by_verify_and_refused_by_load(s3_root):
    config = {"save_dir": s3_root, "host_cache_size": 0.004, "chunk_size_mb": 1, **FAST}
    with CheckpointEngine(config) as engine:
        engine.save(state(5), "iter_0000005", version=5)
        engine.commit("iter_0000005")
        engine.wait_persisted()
    tensor_file = next(n for n in objects(s3_root) if n.endswith(".safetensors"))
    url = object_store.join(s3_root, tensor_file)
    data = bytearray(object_store.get(url))
    data[-100] ^= 0x40  # a bit of the last tensor's bytes
    object_store.put(url, bytes(data))
    _, problems = verify_root(s3_root)
    assert len(problems) == 1 and problems[0].path == tensor_file and "checksum mismatch" in problems[0].what
    with CheckpointEngine(config) as engine, pytest.raises(CheckpointError, match="checksum"):
        engine.load("iter_0000005")


@pytest.mark.multiproc
def test_four_gloo_ranks_commit_one_checkpoint_on_an_object_store(s3_root, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = torchrun_command(4, str(HERE / "_dist_worker.py"), s3_root, str(out))
    proc = subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-6000:]
    outcomes = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert all(o["latest"] == "iter_0000010" and o["checks"] and all(o["checks"].values()) for o in outcomes)
    names = objects(s3_root)
    run_id = outcomes[0]["run_id"]
    assert [n for n in names if "/.reports/" in n] == [f"iter_0000010/.reports/rank-{r:05d}.{run_id}.json"
                                                       for r in range(4)]
    with CheckpointEngine({"save_dir": s3_root, **FAST}) as reader:
        for r in range(4):
            for part in ("model", "optim"):
                assert_same(reader.load("iter_0000010", f"{part}_r{r}"), rank_state(r, part))


def test_the_server_killed_mid_upload_commits_nothing_and_the_next_start_aborts_its_upload(s3_server, s3_root, caplog):
    """A run of the second checkpoint uploaded, the server SIGKILLed before the next: that checkpoint
    fails (``on_failure: continue``: training goes on), no manifest; after a restart the next
    checkpoint commits, the first still loads, and the next start-up aborts the upload left behind."""
    config = {"save_dir": s3_root, "host_cache_size": 0.06, "chunk_size_mb": 4, "on_failure": "continue", **FAST}
    big = {"w": torch.randn(9_000_000, generator=torch.Generator().manual_seed(1))}  # 36 MB: a run of 32 MB, then 4
    runs, kill_at_second_run = killer(s3_server, "iter_0000002")
    engine = CheckpointEngine(config)
    try:
        engine.save(state(1), "iter_0000001", version=1)
        engine.commit("iter_0000001")
        engine.wait_persisted()
        faults.arm(kill_at_second_run)
        try:
            with caplog.at_level(logging.ERROR, logger="megatron_ext.engine"):
                engine.save(big, "iter_0000002", version=2)
                engine.wait_snapshot()
                engine.commit("iter_0000002")
                engine.wait_persisted("iter_0000002")  # abandoned: training goes on
        finally:
            faults.disarm_all()
        assert len(runs) == 2
        assert "iter_0000002 abandoned, training continues" in caplog.text
        assert "uploading part" in caplog.text and "cannot reach the server" in caplog.text
        caplog.clear()
        s3_server.restart()
        engine.save(state(3), "iter_0000003", version=3)
        engine.commit("iter_0000003")
        engine.wait_persisted("iter_0000003")
    finally:
        s3_server.ensure_running()
        engine.shutdown(timeout=60)
    names = objects(s3_root)
    assert "iter_0000002/manifest.json" not in names
    assert uploads(s3_root)  # the killed upload's parts are still on the server
    with caplog.at_level(logging.WARNING, logger="megatron_ext.engine"):
        with CheckpointEngine(config) as engine:
            assert engine.latest() == "iter_0000003"
            assert_same(engine.load("iter_0000001"), state(1))
            assert_same(engine.load("iter_0000003"), state(3))
    assert not uploads(s3_root)
    assert "aborted 1 incomplete upload" in caplog.text
    assert not any(n.startswith("iter_0000002/") for n in objects(s3_root))  # its parts' object never existed


def test_the_server_killed_mid_upload_stops_the_engine_under_on_failure_stop(s3_server, s3_root):
    config = {"save_dir": s3_root, "host_cache_size": 0.06, "chunk_size_mb": 4, **FAST}
    big = {"w": torch.randn(9_000_000, generator=torch.Generator().manual_seed(2))}
    runs, kill_at_second_run = killer(s3_server, "iter_0000002")
    engine = CheckpointEngine(config)
    try:
        engine.save(state(1), "iter_0000001", version=1)
        engine.commit("iter_0000001")
        engine.wait_persisted()
        faults.arm(kill_at_second_run)
        try:
            engine.save(big, "iter_0000002", version=2)
            engine.wait_snapshot()
            engine.commit("iter_0000002")
            with pytest.raises(CheckpointError, match="background checkpointing failed.*cannot reach the server"):
                engine.wait_persisted()
            with pytest.raises(CheckpointError, match="cannot reach the server"):  # stopped: the next save says why
                engine.save(state(3), "iter_0000003", version=3)
        finally:
            faults.disarm_all()
    finally:
        try:
            engine.shutdown(timeout=30)
        except CheckpointError:
            pass  # the same failure, once more
        s3_server.restart()
    with CheckpointEngine(config) as engine:
        assert engine.latest() == "iter_0000001"
        assert_same(engine.load("iter_0000001"), state(1))


@pytest.mark.parametrize("case", ["missing_bucket", "wrong_secret", "read_only", "malformed"])
def test_a_root_that_cannot_be_written_is_refused_at_start_up_in_one_line(s3_server, s3_root, monkeypatch, case):
    root = s3_root
    if case == "missing_bucket":
        root, expected = "s3://no-such-bucket-here/ckpt", "bucket 'no-such-bucket-here' does not exist"
    elif case == "wrong_secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        expected = "access refused"
    elif case == "read_only":
        for key, value in s3_server.env("read_only").items():
            monkeypatch.setenv(key, value)
        expected = "access refused"
    else:
        root, expected = "s3://bucket/a/../b", "may not hold empty"
    with pytest.raises(ConfigError) as refused:
        CheckpointEngine({"save_dir": root, **FAST})
    message = str(refused.value)
    assert expected in message and "\n" not in message
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message and "SECRET" not in message.upper().replace("SECRET_", "")


def test_a_stalled_server_under_supersede_never_blocks_training_and_the_newest_is_written(s3_server, s3_root):
    """The server stopped (SIGSTOP) for a few seconds: under ``supersede`` the copies of later saves
    drop older snapshots instead of waiting for the stuck flush; once it answers again the newest is committed."""
    config = {"save_dir": s3_root, "host_cache_size": 0.03, "chunk_size_mb": 4, "overload_policy": "supersede",
              "max_durable_age": None, **FAST}
    with CheckpointEngine(config) as engine:
        engine.save(state(1), "iter_0000001", version=1)
        engine.commit("iter_0000001")
        engine.wait_persisted()
        s3_server.pause()
        try:
            for step in range(2, 8):
                engine.save({"w": torch.full((3_000_000,), float(step))}, f"iter_{step:07d}", version=step)
                engine.wait_snapshot()
                engine.commit(f"iter_{step:07d}")
                time.sleep(0.2)
        finally:
            s3_server.resume()
        engine.wait_persisted()
        committed = [name for name, _ in list_committed(s3_root)]
    assert committed[-1] == "iter_0000007" and "iter_0000001" in committed
    assert len(committed) < 7, committed  # some snapshots were superseded while the server was stopped
    assert not uploads(s3_root)  # the superseded ones' uploads were aborted, none left behind


def test_a_node_local_level_in_front_of_the_object_store_is_read_first_and_the_store_after_it_is_lost(s3_root, tmp_path):
    """local_dir first, the store staged from it: a load reads node-local while complete there, and the
    objects once the node's copy is gone (a restart on another node)."""
    local = tmp_path / "local"
    config = {"save_dir": s3_root, "local_dir": str(local), "host_cache_size": 0.004, "chunk_size_mb": 1, **FAST}
    with CheckpointEngine(config) as engine:
        engine.save(state(4), "iter_0000004", version=4)
        engine.commit("iter_0000004")
        engine.wait_persisted()
        committed = engine.open_checkpoint("iter_0000004")
        assert_same(committed.reader("rank00000").state(), state(4))
        assert committed.levels_used == {"local"}
    names = objects(s3_root)
    assert any(n.endswith(".safetensors") for n in names) and "iter_0000004/manifest.json" in names
    for path in sorted(local.rglob("*"), reverse=True):
        if path.name != ".datastates.lock":
            path.unlink() if path.is_file() else path.rmdir()
    # Scratch left by readers killed mid-load: a process that is gone, a pid another process now has
    # (its start time differs); kept: this live process's own, and a link (never followed).
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()
    me, started = os.getpid(), object_fetch._started(os.getpid())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stale = [f"{object_fetch.PREFIX}{gone}-{started}-a", f"{object_fetch.PREFIX}{me}-{started + 1}-b"]
    kept = [f"{object_fetch.PREFIX}{me}-{started}-c"]
    for name in stale + kept:
        (local / name / "iter_0000004").mkdir(parents=True)
        (local / name / "iter_0000004" / "rank00000.safetensors").write_bytes(b"x" * 4096)
    (local / f"{object_fetch.PREFIX}{gone}-1-link").symlink_to(elsewhere)
    with CheckpointEngine(config) as engine:
        committed = engine.open_checkpoint("iter_0000004")
        assert_same(committed.reader("rank00000").state(), state(4))
        assert committed.levels_used == {"shared"}
    left = sorted(p.name for p in local.iterdir() if p.name.startswith(object_fetch.PREFIX))
    assert not set(stale) & set(left) and set(kept) <= set(left), left
    assert f"{object_fetch.PREFIX}{gone}-1-link" in left and elsewhere.is_dir()
