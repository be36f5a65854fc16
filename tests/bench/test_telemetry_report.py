"""``megatron-ext telemetry report`` on the telemetry of a real engine run: plots, summary, errors."""

from __future__ import annotations

import json

import pytest

from megatron_ext.bench import telemetry_report
from megatron_ext.bench.common import make_state
from megatron_ext.cli import main as cli_main
from megatron_ext.engine import CheckpointEngine, read_manifest

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """Three checkpoints of an 8 MB state through a real engine; returns the checkpoint root."""
    root = tmp_path_factory.mktemp("telemetry") / "ckpt"
    engine = CheckpointEngine({"host_cache_size": 0.004, "save_dir": str(root)}, rank=0, world_size=1)
    try:
        state = make_state(8 << 20, 1 << 20)
        for step in range(3):
            engine.save(state, f"step{step}")
            engine.wait_snapshot()
            engine.commit(f"step{step}")
        engine.wait_persisted()
    finally:
        engine.shutdown()
    return root


def _records(root) -> list[dict]:
    return [json.loads(line) for line in (root / "datastates_telemetry" / "rank-00000.jsonl").read_text().splitlines()]


def test_report_files_and_summary_match_the_log(engine_run, tmp_path):
    out = tmp_path / "report"
    assert cli_main(["telemetry", "report", str(engine_run / "datastates_telemetry"), "--out", str(out)]) == 0
    for name in ("timeline.png", "throughput.png"):
        assert (out / name).read_bytes()[:8] == PNG
    summary = (out / "summary.md").read_text()

    records = _records(engine_run)
    rows = telemetry_report.summarize(telemetry_report.load(str(engine_run / "datastates_telemetry")))
    assert [row["checkpoint"] for row in rows] == ["step0", "step1", "step2"]
    for row in rows:
        manifest = read_manifest(str(engine_run / row["checkpoint"]))
        assert row["bytes"] == sum(f["size"] + f["state_size"] for f in manifest["files"].values())
        mine = {r["event"]: r for r in records if r["checkpoint"] == row["checkpoint"]}
        assert row["blocked_s"] == mine["snapshot"]["blocked_s"]
        assert row["snapshot_s"] == mine["snapshot"]["seconds"]
        assert row["flush_shared_s"] == mine["flush"]["seconds"]
        assert row["commit_s"] == mine["commit"]["seconds"]
        assert row["ranks"] == 1 and row["failed"] == []
        assert row["throughput_gbps"] == pytest.approx(row["bytes"] / row["blocked_s"] / 1e9)
        assert f"| {row['checkpoint']} | 1 | {row['bytes'] / 1e9:.3f} | {row['blocked_s']:.4f} |" in summary
    total = sum(row["bytes"] for row in rows)
    assert f"3 checkpoint(s), {total / 1e9:.3f} GB in all" in summary


def test_timeline_phases_follow_each_other(engine_run):
    bars = telemetry_report.phases(telemetry_report.load(str(engine_run / "datastates_telemetry" / "rank-00000.jsonl")))
    assert {phase for _, phase, _, _ in bars} == {"snapshot", "flush shared", "commit"}
    assert min(start for _, _, start, _ in bars) == 0.0
    assert all(end >= start for _, _, start, end in bars)
    snapshots = sorted((s, e) for _, phase, s, e in bars if phase == "snapshot")
    flushes = sorted((s, e) for _, phase, s, e in bars if phase == "flush shared")
    commits = sorted((s, e) for _, phase, s, e in bars if phase == "commit")
    assert len(snapshots) == len(flushes) == len(commits) == 3
    for (s0, s1), (f0, f1), (c0, _) in zip(snapshots, flushes, commits):
        assert s1 == f0 and f1 == c0  # snapshot, then flush, then commit, per checkpoint


def test_bad_logs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no telemetry log"):
        telemetry_report.load(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "snapshot", "checkpoint": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        telemetry_report.load(str(bad))
    other = tmp_path / "other.jsonl"
    other.write_text('{"iteration": 1}\n')
    with pytest.raises(ValueError, match="no telemetry records"):
        telemetry_report.load(str(other))
