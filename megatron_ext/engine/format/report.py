"""A rank report (``.reports/rank-RRRRR.<run id>.json``): one rank's record of its files of a
checkpoint, with each file's entry and tensor index, and the share of the manifest a rank posts
once its files are durable. The live commit and ``OfflineWriter`` both make them here, so the two
write the same bytes; docs/FORMAT.md describes the fields."""

from __future__ import annotations

from typing import Sequence

from .manifest import check_share, manifest_part, summary_of
from .names import FORMAT_NAME
from .tensor_file import FileLayout
from .version import FORMAT_VERSION


def file_entry(name: str, tensor_rel: str, sidecar_rel: str, layout: FileLayout, sidecar_size: int,
               file_xxh3: str | None, sidecar_xxh3: str | None, tensor_xxh3: dict[str, str],
               extra: dict | None = None) -> dict:
    """One saved file's entry: where its two files are, their sizes and checksums, its tensors."""
    entry = {
        "name": name,
        "tensor_file": tensor_rel,
        "state_file": sidecar_rel,
        "size": layout.size,
        "state_size": sidecar_size,
        "xxh3_64": file_xxh3,
        "state_xxh3_64": sidecar_xxh3,
        "tensors": {
            s.name: {"dtype": s.dtype, "shape": s.shape, "offsets": [s.start, s.end], "xxh3_64": tensor_xxh3.get(s.name)}
            for s in layout.spans
        },
    }
    if extra is not None:
        entry["extra"] = extra
    return entry


def rank_report(run_id: str, rank: int, world_size: int, checkpoint: str, version: int | None,
                files: Sequence[dict]) -> dict:
    """The rank report of ``files`` (``file_entry``s)."""
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": run_id,
        "rank": rank, "world_size": world_size, "checkpoint": checkpoint,
        "version": version, "files": list(files),
    }


def durable_share(report: dict, data: bytes, rel: str) -> tuple[list, dict[str, bytes]]:
    """What a rank posts once its files are durable: a small head and its share of the manifest,
    encoded here (``manifest_part``) and held, as the exact bytes posted, to the loader's rules
    (``check_share``), so rank 0 joins the N shares without decoding or validating them.

    Never the tensor index: that stays in the report file (``data``, at ``rel``), so the store and
    rank 0 handle O(files) bytes per rank, not O(tensors).
    """
    head, shares = manifest_part(summary_of(report, data, rel))
    check_share(report["checkpoint"], report["run_id"], report["rank"], report["world_size"], head, shares)
    return head, shares


__all__ = ["durable_share", "file_entry", "rank_report"]
