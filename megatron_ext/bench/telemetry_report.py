"""``megatron-ext telemetry report LOG``: a run's telemetry lines as a timeline, a plot of seconds and a summary.

Reads the JSON lines the engine writes (``megatron_ext.engine.telemetry``: one ``snapshot`` and one
``flush`` per level per rank and checkpoint, emitted together once the rank's files are durable,
and one ``commit`` from rank 0). Each record's ``seconds`` counts from the moment the checkpoint's
first tensor was handed to the engine, so a phase's start is ``time - seconds`` of the record that
closes it. ``blocked_spans`` of a snapshot record say when training was blocked for it.

The figures are seconds: blocked (the slowest rank's; what training lost) and until durable per
level. Rates are given only where bytes moved in that time (size / seconds until durable).

The timeline puts each run (``run`` of the records; for older logs a checkpoint saved again starts
a new one) in a section of its own, compresses idle stretches (the restart of a killed job, the
compute between infrequent checkpoints) to a short break marked with its length, draws the
blocked intervals in red on each rank's row, and keeps the legend outside the axes.
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
    """One row per checkpoint and run, in the order they started: size, blocked, snapshot, flush, commit."""
    by_ckpt: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by_ckpt[(r["checkpoint"], r.get("run") or "")].append(r)
    rows = []
    for (name, _), recs in by_ckpt.items():
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
            "run": next((r["run"] for r in recs if r.get("run")), None),
        }
        for level in sorted({r["level"] for r in flushes}):
            slowest = max(r["seconds"] for r in flushes if r["level"] == level)
            row[f"flush_{level}_s"] = slowest
            row[f"durable_{level}_gbps"] = nbytes / slowest / 1e9 if slowest else None
        rows.append(row)
    rows.sort(key=lambda row: row["start_time"])
    return rows


def _start(recs: list[dict], rank: int) -> float:
    """When ``rank`` handed the checkpoint's first tensor to the engine."""
    closing = [r for r in recs if r["rank"] == rank and r["event"] in ("flush", "commit")]
    if not closing:
        closing = [r for r in recs if r["rank"] == rank]
    return min(r["time"] - r.get("seconds", 0.0) for r in closing)


def runs_of(records: list[dict]) -> dict[str, str]:
    """Run id -> label ("run 1", "run 2", ...), in the order the runs started.

    Records carry their engine's ``run`` id (a restarted job is a new engine, so a new run);
    records of logs written before the id existed count as one run, under "".
    """
    starts: dict[str, float] = {}
    for r in records:
        run = r.get("run") or ""
        t = r["time"] - r.get("seconds", 0.0)
        starts[run] = min(starts.get(run, t), t)
    return {run: f"run {n}" for n, run in enumerate(sorted(starts, key=starts.get), start=1)}


def phases(records: list[dict]) -> list[tuple[str, str, float, float]]:
    """Timeline bars ``(rank, phase, start, end)`` in seconds since the first checkpoint started.

    Phases: snapshot, flush per level, commit, and ``training blocked`` (each blocked interval).
    """
    by_key: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for r in records:
        by_key[(r["checkpoint"], r.get("run") or "", r["rank"])].append(r)
    bars = []
    for (_, _, rank), recs in by_key.items():
        start = _start(recs, rank)
        snap = next((r for r in recs if r["event"] == "snapshot"), None)
        snap_end = start + snap["seconds"] if snap else start
        if snap:
            bars.append((f"rank {rank}", "snapshot", start, snap_end))
            for offset, took in snap.get("blocked_spans") or []:
                bars.append((f"rank {rank}", "training blocked", start + offset, start + offset + took))
        for r in recs:
            if r["event"] == "flush":
                bars.append((f"rank {rank}", f"flush {r['level']}", snap_end, start + r["seconds"]))
        flush_end = max((start + r["seconds"] for r in recs if r["event"] == "flush"), default=snap_end)
        for r in recs:
            if r["event"] == "commit":
                bars.append((f"rank {rank}", "commit", flush_end, r["time"]))
    origin = min(b[2] for b in bars) if bars else 0.0
    return [(row, phase, s - origin, e - origin) for row, phase, s, e in bars]


def compress(intervals: list[tuple[float, float]], max_gap: float | None = None,
             gap_width: float | None = None) -> tuple[list[tuple[float, float, float]], float]:
    """A piecewise map of time to the drawn axis that shrinks idle stretches.

    Returns ``(segments, max_gap)``: ``segments`` are ``(t0, t1, x0)``, busy stretches drawn 1:1
    from ``x0``; a gap longer than ``max_gap`` (default: 3 x the median busy stretch, at least 1 s)
    between two of them is drawn ``gap_width`` wide (default: a twentieth of the busy time).
    """
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return [], 0.0
    busy = sorted(b - a for a, b in merged)
    if max_gap is None:
        max_gap = max(3 * busy[len(busy) // 2], 1.0)
    if gap_width is None:
        gap_width = max(sum(busy) / 20, 1e-3)
    segments: list[tuple[float, float, float]] = []
    x = 0.0
    t0, t1 = merged[0]
    for a, b in merged[1:]:
        if a - t1 > max_gap:
            segments.append((t0, t1, x))
            x += (t1 - t0) + gap_width
            t0 = a
        t1 = b
    segments.append((t0, t1, x))
    return segments, max_gap


def _to_axis(segments: list[tuple[float, float, float]], t: float) -> float:
    for t0, t1, x0 in segments:
        if t <= t1:
            return x0 + max(t - t0, 0.0)
    t0, t1, x0 = segments[-1]
    return x0 + (t - t0)


def timeline_layout(records: list[dict]) -> dict:
    """Bars on the compressed axis, the breaks (with the seconds they stand for) and the run boundaries."""
    bars = phases(records)
    segments, _ = compress([(s, e) for _, phase, s, e in bars if phase != "training blocked"])
    drawn = [(row, phase, _to_axis(segments, s), _to_axis(segments, e)) for row, phase, s, e in bars]
    breaks = [(_to_axis(segments, prev[1]) + (nxt[2] - (prev[2] + prev[1] - prev[0])) / 2,
               f"{nxt[0] - prev[1]:.0f} s idle" if nxt[0] - prev[1] >= 10 else f"{nxt[0] - prev[1]:.1f} s idle")
              for prev, nxt in zip(segments, segments[1:])]
    labels = runs_of(records)
    origin = min((r["time"] - r.get("seconds", 0.0) for r in records), default=0.0)
    first_of_run: dict[str, float] = {}
    for r in records:
        label = labels[r.get("run") or ""]
        t = r["time"] - r.get("seconds", 0.0) - origin
        first_of_run[label] = min(first_of_run.get(label, t), t)
    separators = sorted((_to_axis(segments, t), label) for label, t in first_of_run.items()) if segments else []
    ticks = [(x0, f"{t0:.1f}") for t0, _, x0 in segments]
    if segments:
        t0, t1, x0 = segments[-1]
        ticks.append((x0 + t1 - t0, f"{t1:.1f}"))
    return {"bars": drawn, "breaks": breaks, "runs": separators, "ticks": ticks}


def format_summary(rows: list[dict]) -> str:
    levels = sorted({k[len("flush_"):-len("_s")] for row in rows for k in row if k.startswith("flush_") and k.endswith("_s")})
    head = ["checkpoint", "ranks", "GB", "blocked s", "snapshot s",
            *[f"durable {lv} s (GB/s)" for lv in levels], "commit s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        durable = [f"{_fmt(row.get(f'flush_{lv}_s'), 3)} ({_fmt(row.get(f'durable_{lv}_gbps'), 2)})" for lv in levels]
        cells = [row["checkpoint"] + (" (FAILED)" if row["failed"] else ""), str(row["ranks"]),
                 f"{row['bytes'] / 1e9:.3f}", _fmt(row["blocked_s"], 4), _fmt(row["snapshot_s"], 3), *durable,
                 _fmt(row["commit_s"], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    total_bytes = sum(row["bytes"] for row in rows)
    total_blocked = sum(row["blocked_s"] or 0.0 for row in rows)
    runs = len({row["run"] for row in rows if row.get("run")}) or 1
    lines.append("")
    lines.append(f"{len(rows)} checkpoint(s) in {runs} run(s), {total_bytes / 1e9:.3f} GB in all, training blocked "
                 f"{total_blocked:.4f} s in all. Blocked s: the slowest rank's time in save and wait_snapshot; "
                 "durable s: from the first save call until that level's files were durable (GB/s: bytes made "
                 "durable per second).")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int, kind: str = "f") -> str:
    return "—" if value is None else f"{value:.{digits}{kind}}"


def report(log: str, out: str) -> dict:
    """Write ``timeline.png``, ``seconds.png`` and ``summary.md`` under ``out``; return the summary."""
    records = load(log)
    rows = summarize(records)
    os.makedirs(out, exist_ok=True)
    layout = timeline_layout(records)
    plots.timeline(os.path.join(out, "timeline.png"), f"checkpoint phases per rank ({log})", layout["bars"],
                   breaks=layout["breaks"], separators=layout["runs"], ticks=layout["ticks"])
    names = [row["checkpoint"] + (f" ({labels})" if (labels := _run_label(row, rows)) else "") for row in rows]
    series = {"training blocked": [row["blocked_s"] for row in rows]}
    for level in sorted({k[len("flush_"):-len("_s")] for row in rows for k in row
                         if k.startswith("flush_") and k.endswith("_s")}):
        series[f"until durable ({level})"] = [row.get(f"flush_{level}_s") for row in rows]
    plots.grouped_bars(os.path.join(out, "seconds.png"), "seconds per checkpoint: training blocked, and until "
                       "durable", names, series, "seconds (log)", log=True)
    text = format_summary(rows)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(f"# Telemetry of {log}\n\n{text}\n")
    return {"checkpoints": rows, "text": text, "files": ["timeline.png", "seconds.png", "summary.md"]}


def _run_label(row: dict, rows: list[dict]) -> str:
    """"run N" when the log holds several runs."""
    runs = [r.get("run") for r in rows]
    distinct = list(dict.fromkeys(r for r in runs if r))
    if len(distinct) < 2 or not row.get("run"):
        return ""
    return f"run {distinct.index(row['run']) + 1}"


def main(args) -> int:
    result = report(args.log, args.out)
    if args.json:
        print(json.dumps({"checkpoints": result["checkpoints"],
                          "files": [os.path.join(args.out, f) for f in result["files"]]}, indent=1, default=str))
        return 0
    print(result["text"])
    print(f"\nwrote {', '.join(os.path.join(args.out, f) for f in result['files'])}")
    return 0
