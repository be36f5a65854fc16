"""What a checkpoint directory holds: checkpoints, commit state, levels, ranks and sizes."""

from __future__ import annotations

import os

from .commit import MANIFEST, REPORTS, read_manifest
from .jobs import CheckpointError


def _dir_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(base, name))
            except OSError:
                pass
    return total


def describe(root: str, local_dir: str | None = None) -> list[dict]:
    """One record per checkpoint directory under ``root`` (ours: with a manifest or reports)."""
    rows = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        has_manifest = os.path.exists(os.path.join(path, MANIFEST))
        if not has_manifest and not os.path.isdir(os.path.join(path, REPORTS)):
            continue
        row = {"checkpoint": name, "committed": False, "bytes_on_disk": _dir_bytes(path)}
        try:
            manifest = read_manifest(path) if has_manifest else None
        except CheckpointError as exc:
            row["error"] = str(exc)
            manifest = None
        if manifest is not None:
            files = manifest["files"].values()
            row.update(committed=True, version=manifest.get("version"), run_id=manifest["run_id"],
                       world_size=manifest["world_size"], files=len(manifest["files"]),
                       ranks=len({f["rank"] for f in files}),
                       bytes=sum(f["size"] + f["state_size"] for f in files),
                       tensors=sum(len(f["tensors"]) for f in files),
                       committed_at=manifest.get("committed_at"))
            levels = ["shared"]
            if local_dir and os.path.isdir(os.path.join(local_dir, name, REPORTS)):
                levels.append("local")
            row["levels"] = levels
        else:
            reports = os.listdir(os.path.join(path, REPORTS)) if os.path.isdir(os.path.join(path, REPORTS)) else []
            row["rank_reports"] = len([r for r in reports if not r.endswith((".error.json", ".skipped.json"))])
            row["error_reports"] = len([r for r in reports if r.endswith(".error.json")])
            row["skip_reports"] = len([r for r in reports if r.endswith(".skipped.json")])
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'checkpoint':<20} {'state':<12} {'version':>8} {'ranks':>5} {'files':>5} {'MB':>10}  levels"]
    for r in rows:
        if r["committed"]:
            lines.append(f"{r['checkpoint']:<20} {'committed':<12} {str(r['version']):>8} {r['ranks']:>5} "
                         f"{r['files']:>5} {r['bytes'] / 1e6:>10.1f}  {'+'.join(r['levels'])}")
        else:
            state = "unreadable" if "error" in r else "uncommitted"
            lines.append(f"{r['checkpoint']:<20} {state:<12} {'-':>8} {r.get('rank_reports', 0):>5} "
                         f"{'-':>5} {r['bytes_on_disk'] / 1e6:>10.1f}  "
                         f"{r.get('error_reports', 0)} error, {r.get('skip_reports', 0)} skip report(s)"
                         if state == "uncommitted" else r["error"])
    committed = [r for r in rows if r["committed"]]
    lines.append(f"{len(committed)} committed, {len(rows) - len(committed)} not; newest committed: "
                 f"{max(committed, key=lambda r: (r['version'] or 0, r['committed_at'] or 0))['checkpoint'] if committed else 'none'}")
    return "\n".join(lines)
