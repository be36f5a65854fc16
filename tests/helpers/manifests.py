"""Manifests built and read the short way, for tests: the same product functions rank 0 and the
readers use (``format.manifest``), composed without a commit store or a ``TensorIndex`` kept."""

from __future__ import annotations

from megatron_ext.engine.format.manifest import (
    MANIFEST_SHARES,
    TensorIndex,
    assemble_manifest,
    manifest_part,
    summarize_heads,
    summary_of,
)
from megatron_ext.engine.format.names import MANIFEST
from megatron_ext.engine.format.validation import parse_json


def summarize_report(report_bytes: bytes, rel: str) -> dict:
    """``summary_of`` a serialized report (read back from disk)."""
    return summary_of(parse_json(report_bytes, rel), report_bytes, rel)



def build_manifest(checkpoint: str, run_id: str, version: int | None, world_size: int, summaries: list[dict],
                   attempt_of: str | None = None) -> dict:
    """The manifest ``assemble_manifest`` writes for these summaries, as a dict."""
    heads, shares = [], {name: [] for name in MANIFEST_SHARES}
    for summary in summaries:
        head, share = manifest_part(summary)
        heads.append([summary["rank"], *head])
        for name in MANIFEST_SHARES:
            shares[name].append(share[name])
    summary = summarize_heads(checkpoint, heads, range(world_size))
    _, data = assemble_manifest(checkpoint, run_id, version, world_size, summary, shares, attempt_of)
    return parse_json(data, f"{checkpoint}/{MANIFEST}")



def file_tensors(checkpoint_dir: str, manifest: dict, name: str) -> dict:
    """File ``name``'s tensor index from a validated manifest of either format.

    One-off: each call reads the rank's report again; callers that read several files keep a ``TensorIndex``.
    """
    return TensorIndex(checkpoint_dir, manifest).tensors(name)
