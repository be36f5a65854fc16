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


def test_report_files_and_summary_match_the_log(engine_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli_main(["telemetry", "report", str(engine_run / "datastates_telemetry"), "--out", str(out)]) == 0
    for name in ("timeline.png", "seconds.png"):
        assert (out / name).read_bytes()[:8] == PNG
    summary = (out / "summary.md").read_text()

    records = _records(engine_run)
    rows = telemetry_report.summarize(telemetry_report.load(str(engine_run / "datastates_telemetry")))
    assert [row["checkpoint"] for row in rows] == ["step0", "step1", "step2"]
    capsys.readouterr()  # the text report printed above
    assert cli_main(["telemetry", "report", str(engine_run / "datastates_telemetry"), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [row["checkpoint"] for row in printed["checkpoints"]] == ["step0", "step1", "step2"]
    assert printed["files"] == [str(out / f) for f in ("timeline.png", "seconds.png", "summary.md")]
    for row in rows:
        manifest = read_manifest(str(engine_run / row["checkpoint"]))
        assert row["bytes"] == sum(f["size"] + f["state_size"] for f in manifest["files"].values())
        mine = {r["event"]: r for r in records if r["checkpoint"] == row["checkpoint"]}
        assert row["blocked_s"] == mine["snapshot"]["blocked_s"]
        assert row["snapshot_s"] == mine["snapshot"]["seconds"]
        assert row["flush_shared_s"] == mine["flush"]["seconds"]
        assert row["commit_s"] == mine["commit"]["seconds"]
        assert row["ranks"] == 1 and row["failed"] == []
        assert row["durable_shared_gbps"] == pytest.approx(row["bytes"] / row["flush_shared_s"] / 1e9)
        assert "throughput_gbps" not in row  # size / blocked is not a rate
        assert f"| {row['checkpoint']} | 1 | {row['bytes'] / 1e9:.3f} | {row['blocked_s']:.4f} |" in summary
        # When training was blocked: the save call's interval, within what blocked_s counts.
        spans = mine["snapshot"]["blocked_spans"]
        assert spans and sum(took for _, took in spans) == pytest.approx(row["blocked_s"], abs=1e-5)
    total = sum(row["bytes"] for row in rows)
    assert f"3 checkpoint(s) in 1 run(s), {total / 1e9:.3f} GB in all" in summary


def test_timeline_phases_follow_each_other(engine_run):
    bars = telemetry_report.phases(telemetry_report.load(str(engine_run / "datastates_telemetry" / "rank-00000.jsonl")))
    assert {phase for _, phase, _, _ in bars} == {"snapshot", "flush shared", "commit", "training blocked"}
    assert min(start for _, _, start, _ in bars) == 0.0  # the first save call
    blocked = [b for b in bars if b[1] == "training blocked"]
    bars = [b for b in bars if b[1] != "training blocked"]
    assert len(blocked) >= 3
    assert all(end >= start for _, _, start, end in bars)
    snapshots = sorted((s, e) for _, phase, s, e in bars if phase == "snapshot")
    flushes = sorted((s, e) for _, phase, s, e in bars if phase == "flush shared")
    commits = sorted((s, e) for _, phase, s, e in bars if phase == "commit")
    assert len(snapshots) == len(flushes) == len(commits) == 3
    for (s0, s1), (f0, f1), (c0, _) in zip(snapshots, flushes, commits):
        assert s1 == f0 and f1 == c0  # snapshot, then flush, then commit, per checkpoint


def test_timeline_of_a_restarted_job_separates_runs_and_cuts_the_gap(tmp_path):
    """Two engines (a job killed and resumed) 20 s apart in one log: two runs, the idle stretch cut out
    of the axis and labelled, the blocked intervals drawn, the legend outside the axes."""
    root = tmp_path / "ckpt"
    records = []
    for run in range(2):
        engine = CheckpointEngine({"host_cache_size": 0.004, "save_dir": str(root)}, rank=0, world_size=1)
        try:
            for step in range(2):
                name = f"step{step + run}"  # the resumed run saves step1 again
                engine.save(make_state(1 << 20, 1 << 18), name, version=step + run)
                engine.wait_snapshot()
                engine.commit(name)
            engine.wait_persisted()
        finally:
            engine.shutdown()
    records = telemetry_report.load(str(root / "datastates_telemetry"))
    first_run = {r["run"] for r in records if r["checkpoint"] == "step0"}
    for r in records:  # the restart took 20 s
        if r.get("run") not in first_run:
            r["time"] += 20.0
    rows = telemetry_report.summarize(records)
    assert [row["checkpoint"] for row in rows] == ["step0", "step1", "step1", "step2"]
    assert len({row["run"] for row in rows}) == 2
    layout = telemetry_report.timeline_layout(records)
    assert [label for _, label in layout["runs"]] == ["run 1", "run 2"]
    assert len(layout["breaks"]) == 1 and layout["breaks"][0][1].endswith("s idle")
    assert float(layout["breaks"][0][1].split()[0]) > 19
    drawn = max(e for *_, e in layout["bars"])
    assert drawn < 10  # 20 s of idle time is not drawn at scale
    assert any(phase == "training blocked" for _, phase, _, _ in layout["bars"])
    out = tmp_path / "report"
    import json as _json
    log = tmp_path / "shifted.jsonl"
    log.write_text("".join(_json.dumps(r) + "\n" for r in records))
    result = telemetry_report.report(str(log), str(out))
    assert "in 2 run(s)" in result["text"]
    assert (out / "timeline.png").read_bytes()[:8] == PNG


def test_plot_legends_stay_outside_the_axes(tmp_path, monkeypatch):
    from megatron_ext.bench import plots

    placed = []
    original = plots.plt.Axes.legend

    def legend(ax, *args, **kwargs):
        placed.append(kwargs)
        return original(ax, *args, **kwargs)

    monkeypatch.setattr(plots.plt.Axes, "legend", legend)
    plots.grouped_bars(str(tmp_path / "a.png"), "t", ["x"], {"datastates": [1.0], "memcpy (limit)": [0.5]}, "s")
    plots.timeline(str(tmp_path / "b.png"), "t", [("rank 0", "snapshot", 0.0, 1.0)])
    assert placed and all(kw.get("bbox_to_anchor", (0, 0))[0] > 1.0 for kw in placed)


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
