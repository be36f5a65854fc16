"""What a checkpoint directory holds: checkpoints, commit state, levels, ranks, sizes and layout.

The layout is whatever the adapter recorded in each file's manifest ``extra["layout"]``; only the
entries every file agrees on are shown (for Megatron: world size, TP, PP, DP), so the engine
needs no knowledge of what they mean.
"""

from __future__ import annotations

import os
from typing import Callable

from .. import object_store
from ..errors import CheckpointError
from ..files import tree_bytes
from ..format.catalog import checkpoint_dirs, commit_order, manifest_exists, read_manifest
from ..object_store import is_object_url
from ..format.entries import FileEntry
from ..format.names import ERROR_REPORT_SUFFIX, REPORTS, SKIP_REPORT_SUFFIX
from .committed import CommittedCheckpoint, ReadOptions, open_committed


def common_layout(files: list[FileEntry]) -> dict:
    """The ``extra["layout"]`` entries that every file of a checkpoint records with the same value."""
    layouts = [f.extra.get("layout") if isinstance(f.extra, dict) else None for f in files]
    if not layouts or any(not isinstance(layout, dict) for layout in layouts):
        return {}
    return {k: v for k, v in layouts[0].items() if all(layout.get(k) == v for layout in layouts[1:])}


def describe(root: str, local_dir: str | None = None, only: str | None = None,
             classify: Callable[[dict], str] | None = None,
             progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """One record per checkpoint directory under ``root`` (ours: with a manifest or reports), or of ``only``.

    ``classify(manifest)`` names a committed checkpoint's kind (the row's ``kind``), e.g. which
    framework wrote it; ``progress(nbytes, checkpoints)`` is called after each checkpoint.
    """
    on_objects = is_object_url(root)
    if not (on_objects or os.path.isdir(root)):
        raise CheckpointError(f"{root} is not a directory")
    rows = []
    names = [only] if only is not None else sorted(checkpoint_dirs(root))
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".") or not (on_objects or os.path.isdir(path)):
            continue
        has_manifest = manifest_exists(path)
        reports = _reports(path)
        if not has_manifest and reports is None:
            continue
        stored = sum(size for _, size in object_store.walk(path)) if on_objects else tree_bytes(path)
        row = {"checkpoint": name, "committed": False, "bytes_on_disk": stored}
        try:
            manifest = read_manifest(path) if has_manifest else None
        except CheckpointError as exc:
            row["error"] = str(exc)
            manifest = None
        if manifest is not None:
            committed = open_committed(root, name, ReadOptions(verify=False), manifest=manifest)
            files = committed.files()
            by_rank: dict[int, int] = {}
            for f in files:
                by_rank[f.rank] = by_rank.get(f.rank, 0) + f.total_bytes
            row.update(committed=True, version=committed.version, run_id=committed.run_id,
                       world_size=committed.world_size, files=len(files), ranks=len(by_rank),
                       bytes=sum(f.total_bytes for f in files),
                       tensors=_tensor_count(committed, row),
                       committed_at=manifest.get("committed_at"),
                       bytes_by_rank={str(r): by_rank[r] for r in sorted(by_rank)},
                       layout=common_layout(files))
            if classify is not None:
                row["kind"] = classify(manifest)
            levels = ["shared"]
            if local_dir and os.path.isdir(os.path.join(local_dir, name, REPORTS)):
                levels.append("local")
            row["levels"] = levels
        else:
            reports = reports or []
            row["rank_reports"] = len([r for r in reports if not r.endswith((ERROR_REPORT_SUFFIX, SKIP_REPORT_SUFFIX))])
            row["error_reports"] = len([r for r in reports if r.endswith(ERROR_REPORT_SUFFIX)])
            row["skip_reports"] = len([r for r in reports if r.endswith(SKIP_REPORT_SUFFIX)])
        rows.append(row)
        if progress is not None:
            progress(row.get("bytes", 0), 1)
    return rows


def _reports(checkpoint_dir: str) -> list[str] | None:
    """The names in a checkpoint's ``.reports``, or None if it has none."""
    reports = os.path.join(checkpoint_dir, REPORTS)
    if is_object_url(reports):
        names = object_store.list_children(reports)[1]
        return names or None
    return os.listdir(reports) if os.path.isdir(reports) else None


def _layout_text(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items() if not k.endswith("_rank")) or "-"


def _rank_spread(by_rank: dict) -> str:
    sizes = list(by_rank.values())
    return f"{min(sizes) / 1e6:.1f}-{max(sizes) / 1e6:.1f}" if sizes else "-"


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'checkpoint':<20} {'state':<12} {'version':>8} {'ranks':>5} {'files':>5} {'MB':>10} "
             f"{'MB/rank':>13}  {'levels':<12} {'kind':<10} layout"]
    for r in rows:
        if r["committed"]:
            lines.append(f"{r['checkpoint']:<20} {'committed':<12} {str(r['version']):>8} {r['ranks']:>5} "
                         f"{r['files']:>5} {r['bytes'] / 1e6:>10.1f} {_rank_spread(r['bytes_by_rank']):>13}  "
                         f"{'+'.join(r['levels']):<12} {r.get('kind', '-'):<10} {_layout_text(r['layout'])}")
        elif "error" in r:
            lines.append(f"{r['checkpoint']:<20} {'unreadable':<12} {r['error']}")
        else:
            lines.append(f"{r['checkpoint']:<20} {'uncommitted':<12} {'-':>8} {r.get('rank_reports', 0):>5} "
                         f"{'-':>5} {r['bytes_on_disk'] / 1e6:>10.1f}  "
                         f"{r.get('error_reports', 0)} error, {r.get('skip_reports', 0)} skip report(s)")
    committed = [r for r in rows if r["committed"]]
    lines.append(f"{len(committed)} committed, {len(rows) - len(committed)} not; newest committed: "
                 f"{max(committed, key=commit_order)['checkpoint'] if committed else 'none'}")
    return "\n".join(lines)


def _tensor_count(committed: CommittedCheckpoint, row: dict) -> int | None:
    """Tensors over all files: format 2 reads every rank report (None, and the row's error, if one is unusable)."""
    try:
        return sum(len(committed.index.tensors(f.name)) for f in committed.files())
    except CheckpointError as exc:
        row["error"] = str(exc)
        return None
