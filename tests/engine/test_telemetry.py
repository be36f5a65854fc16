"""Telemetry: one JSON line per checkpoint and level (snapshot to host, flush to each storage
level, commit on rank 0), with bytes, seconds, rate and the time the caller was blocked."""

from __future__ import annotations

import json

import torch

from megatron_ext.engine import read_manifest

from helpers.states import TINY


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_line_per_checkpoint_and_level(make_engine, tmp_path):
    root = tmp_path / "ckpt"
    engine = make_engine(**TINY)
    for step in (1, 2):
        engine.save({"w": torch.randn(30_000), "step": step}, f"s{step}", version=step)
        engine.wait_snapshot()
        engine.commit(f"s{step}")
    engine.wait_persisted()
    records = _lines(root / "datastates_telemetry" / "rank-00000.jsonl")
    assert sorted((r["checkpoint"], r["event"], r["level"]) for r in records) == sorted(
        (f"s{s}", e, lvl) for s in (1, 2) for e, lvl in (("snapshot", "host"), ("flush", "shared"), ("commit", "all")))
    assert records == list(engine.telemetry.records)  # the file and the in-memory copy agree
    for r in records:
        manifest = read_manifest(str(root / r["checkpoint"]))
        total = sum(f["size"] + f["state_size"] for f in manifest["files"].values())
        assert r["rank"] == 0 and r["bytes"] == total
        assert isinstance(r["seconds"], float) and r["seconds"] >= 0
        assert r["gbps"] is None or (isinstance(r["gbps"], float) and r["gbps"] >= 0)
        if r["event"] in ("snapshot", "flush"):
            assert isinstance(r["blocked_s"], float) and r["blocked_s"] >= 0
        else:
            assert r["world_size"] == 1


def test_multilevel_and_custom_path(make_engine, tmp_path):
    path = tmp_path / "tele" / "r{rank}.jsonl"
    engine = make_engine(**TINY, local_dir=str(tmp_path / "local"), telemetry_path=str(path))
    engine.save({"w": torch.randn(10_000)}, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    records = _lines(tmp_path / "tele" / "r0.jsonl")
    assert sorted((r["event"], r["level"]) for r in records) == [
        ("commit", "all"), ("flush", "local"), ("flush", "shared"), ("snapshot", "host")]
    assert all("blocked_s" in r for r in records if r["event"] != "commit")
    assert not (tmp_path / "ckpt" / "datastates_telemetry").exists()


def test_non_zero_rank_writes_no_commit_line(make_engine, tmp_path):
    # Both ranks of a 2-rank run as two engines in one process (same run id, no collectives).
    r0 = make_engine(**TINY, rank=0, world_size=2, run_id="00000000beef")
    r1 = make_engine(**TINY, rank=1, world_size=2, run_id="00000000beef")
    for engine in (r0, r1):
        engine.save({"w": torch.full((1000,), float(engine.rank))}, "c1", f"r{engine.rank}")
        engine.commit("c1")
    r0.wait_persisted()
    r1.wait_persisted()
    tele = tmp_path / "ckpt" / "datastates_telemetry"
    assert [r["event"] for r in _lines(tele / "rank-00001.jsonl") if r["event"] == "commit"] == []
    assert [r["event"] for r in _lines(tele / "rank-00000.jsonl") if r["event"] == "commit"] == ["commit"]


def test_the_flush_line_carries_the_engines_cpu(make_engine, tmp_path, monkeypatch):
    """The last level's flush line: the engine's CPU seconds since the last reading (its named
    threads and its I/O worker), the bytes since then, and per GB; the levels before it carry none.
    Read at the first checkpoint, then at most every ``CPU_READ_INTERVAL_S`` (here: every time)."""
    from megatron_ext.engine.save.commit.committer import Committer

    monkeypatch.setattr(Committer, "CPU_READ_INTERVAL_S", 0.0)
    engine = make_engine(**TINY, local_dir=str(tmp_path / "local"))
    state = {"w": torch.randn(8 << 20)}  # 32 MB: copied, hashed and written twice per checkpoint
    for step in (1, 2, 3):
        engine.save(state, f"s{step}", version=step)
        engine.commit(f"s{step}")
    engine.wait_persisted()
    flushes = [r for r in engine.telemetry.records if r["event"] == "flush"]
    assert all("cpu_s" not in r for r in flushes if r["level"] == "local")
    shared = [r for r in flushes if r["level"] == "shared"]
    assert len(shared) == 3
    for r in shared:
        assert r["cpu_s"] >= 0 and r["cpu_bytes"] == r["bytes"]
        assert abs(r["cpu_s_per_gb"] - r["cpu_s"] / (r["bytes"] / 1e9)) < 1e-3
    assert sum(r["cpu_s"] for r in shared) > 0


def test_the_engines_cpu_is_read_at_most_every_interval(make_engine, tmp_path):
    """With the default interval, checkpoints in quick succession: the first line reads it, the
    others carry none, and a later reading covers the bytes of all the checkpoints since."""
    engine = make_engine(**TINY)
    for step in (1, 2, 3):
        engine.save({"w": torch.randn(1000)}, f"s{step}", version=step)
        engine.commit(f"s{step}")
    engine.wait_persisted()
    flushes = [r for r in engine.telemetry.records if r["event"] == "flush"]
    assert ["cpu_s" in r for r in flushes] == [True, False, False]
    assert flushes[0]["cpu_bytes"] == flushes[0]["bytes"]


def test_the_cpu_meter_counts_the_engines_live_threads_only():
    import threading
    import time

    from megatron_ext.engine.threads import CpuMeter, EngineThread

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    meter = CpuMeter()
    meter.since_last()
    burned, gate = threading.Event(), threading.Event()

    def work() -> None:
        burn(0.3)
        burned.set()
        gate.wait(10)

    worker = EngineThread(work, "datastates-test-burn")
    worker.start()
    outside = threading.Thread(target=burn, args=(0.3,))  # not the engine's: not counted
    outside.start()
    outside.join()
    assert burned.wait(10)
    used = meter.since_last()
    gate.set()
    worker.join()
    assert 0.25 <= used <= 0.6  # /proc counts in clock ticks (10 ms)
    assert meter.since_last() < 0.05  # an ended thread adds nothing
