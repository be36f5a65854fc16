"""``megatron-ext telemetry report LOG``: a run's telemetry lines as a timeline, a throughput plot and a summary.

Reads the JSON lines the engine writes (``megatron_ext.engine.telemetry``: one ``snapshot`` and one
``flush`` per level per rank and checkpoint, emitted together once the rank's files are durable,
and one ``commit`` from rank 0). Each record's ``seconds`` counts from the moment the checkpoint's
first tensor was handed to the engine, so a phase's start is ``time - seconds`` of the record that
closes it. Checkpoint throughput is the paper's: checkpoint size of all ranks / time the slowest
rank was blocked.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

from megatron_ext.bench import plots


def load(path: str) -> list[dict]:
    """Every record of a telemetry file, or of every ``*.jsonl`` under a directory (recursively)."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"no telemetry log at {path}")
    records = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{name}:{number}: not a JSON line ({exc})") from exc
                if "event" in record and "checkpoint" in record:
                    records.append(record)
    if not records:
        raise ValueError(f"no telemetry records in {path} (expected the engine's JSON lines)")
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per checkpoint, in the order they started: size, blocked, snapshot, flush, commit, throughput."""
    by_ckpt: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_ckpt[r["checkpoint"]].append(r)
    rows = []
    for name, recs in by_ckpt.items():
        snaps = [r for r in recs if r["event"] == "snapshot"]
        flushes = [r for r in recs if r["event"] == "flush"]
        commits = [r for r in recs if r["event"] == "commit"]
        failed = [r for r in recs if r["event"] == "failed"]
        blocked = max((r.get("blocked_s", 0.0) for r in snaps), default=None)
        nbytes = sum(r["bytes"] for r in snaps)
        row = {
            "checkpoint": name,
            "ranks": len({r["rank"] for r in snaps}),
            "bytes": nbytes,
            "start_time": min(_start(recs, r["rank"]) for r in snaps) if snaps else min(r["time"] for r in recs),
            "blocked_s": blocked,
            "snapshot_s": max((r["seconds"] for r in snaps), default=None),
            "commit_s": commits[0]["seconds"] if commits else None,
            "failed": [r.get("error", "") for r in failed],
            "throughput_gbps": nbytes / blocked / 1e9 if blocked else None,
        }
        for level in sorted({r["level"] for r in flushes}):
            slowest = max(r["seconds"] for r in flushes if r["level"] == level)
            row[f"flush_{level}_s"] = slowest
            row[f"flush_{level}_gbps"] = nbytes / slowest / 1e9 if slowest else None
        rows.append(row)
    rows.sort(key=lambda row: row["start_time"])
    return rows


def _start(recs: list[dict], rank: int) -> float:
    """When ``rank`` handed the checkpoint's first tensor to the engine."""
    closing = [r for r in recs if r["rank"] == rank and r["event"] in ("flush", "commit")]
    if not closing:
        closing = [r for r in recs if r["rank"] == rank]
    return min(r["time"] - r.get("seconds", 0.0) for r in closing)


def phases(records: list[dict]) -> list[tuple[str, str, float, float]]:
    """Timeline bars ``(rank, phase, start, end)`` in seconds since the first checkpoint started."""
    by_key: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        by_key[(r["checkpoint"], r["rank"])].append(r)
    bars = []
    for (_, rank), recs in by_key.items():
        start = _start(recs, rank)
        snap = next((r for r in recs if r["event"] == "snapshot"), None)
        snap_end = start + snap["seconds"] if snap else start
        if snap:
            bars.append((f"rank {rank}", "snapshot", start, snap_end))
        for r in recs:
            if r["event"] == "flush":
                bars.append((f"rank {rank}", f"flush {r['level']}", snap_end, start + r["seconds"]))
        flush_end = max((start + r["seconds"] for r in recs if r["event"] == "flush"), default=snap_end)
        for r in recs:
            if r["event"] == "commit":
                bars.append((f"rank {rank}", "commit", flush_end, r["time"]))
    origin = min(b[2] for b in bars) if bars else 0.0
    return [(row, phase, s - origin, e - origin) for row, phase, s, e in bars]


def format_summary(rows: list[dict]) -> str:
    levels = sorted({k[len("flush_"):-len("_s")] for row in rows for k in row if k.startswith("flush_") and k.endswith("_s")})
    head = ["checkpoint", "ranks", "GB", "blocked s", "GB/s (size/blocked)", "snapshot s",
            *[f"flush {lv} s" for lv in levels], "commit s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["checkpoint"] + (" (FAILED)" if row["failed"] else ""), str(row["ranks"]),
                 f"{row['bytes'] / 1e9:.3f}", _fmt(row["blocked_s"], 4), _fmt(row["throughput_gbps"], 3, "g"),
                 _fmt(row["snapshot_s"], 3), *[_fmt(row.get(f"flush_{lv}_s"), 3) for lv in levels],
                 _fmt(row["commit_s"], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    total_bytes = sum(row["bytes"] for row in rows)
    total_blocked = sum(row["blocked_s"] or 0.0 for row in rows)
    lines.append("")
    lines.append(f"{len(rows)} checkpoint(s), {total_bytes / 1e9:.3f} GB in all, training blocked "
                 f"{total_blocked:.4f} s in all"
                 + (f", {total_bytes / total_blocked / 1e9:.3g} GB/s overall" if total_blocked > 0 else ""))
    return "\n".join(lines)


def _fmt(value: float | None, digits: int, kind: str = "f") -> str:
    return "—" if value is None else f"{value:.{digits}{kind}}"


def report(log: str, out: str) -> dict:
    """Write ``timeline.png``, ``throughput.png`` and ``summary.md`` under ``out``; return the summary."""
    records = load(log)
    rows = summarize(records)
    os.makedirs(out, exist_ok=True)
    plots.timeline(os.path.join(out, "timeline.png"), f"checkpoint phases per rank ({log})", phases(records))
    names = [row["checkpoint"] for row in rows]
    series = {"size / blocked (training's view)": [row["throughput_gbps"] for row in rows]}
    for level in sorted({k[len("flush_"):-len("_gbps")] for row in rows for k in row if k.endswith("_gbps") and k.startswith("flush_")}):
        series[f"size / flush {level} time"] = [row.get(f"flush_{level}_gbps") for row in rows]
    plots.grouped_bars(os.path.join(out, "throughput.png"), "checkpoint throughput per checkpoint",
                       names, series, "GB/s", log=True)
    text = format_summary(rows)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(f"# Telemetry of {log}\n\n{text}\n")
    return {"checkpoints": rows, "text": text, "files": ["timeline.png", "throughput.png", "summary.md"]}


def main(args) -> int:
    result = report(args.log, args.out)
    print(result["text"])
    print(f"\nwrote {', '.join(os.path.join(args.out, f) for f in result['files'])}")
    return 0
