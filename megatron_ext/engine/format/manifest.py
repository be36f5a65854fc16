"""The manifest: a checkpoint's commit marker and the only index of its files.

Rank 0 assembles it from the ranks' shares (``assemble_manifest``) and holds the result to the
format (``check_assembled``) before it commits; every reader trusts it only after validation
(format/validation.py, docs/FORMAT.md).

Format 2 keeps rank 0's work independent of the number of tensors: the manifest lists each rank's
report (the per-tensor index that rank wrote) with its size and checksum instead of inlining
every tensor. ``TensorIndex`` reads a report once, holds it to the manifest and validates its
tensors exactly as format 1's inline ones; format 1 manifests still load.
"""

from __future__ import annotations

import json
import logging
import os
import time

import xxhash

from ..errors import CheckpointError
from .names import FORMAT_NAME, MANIFEST, REPORTS, report_name
from .safetensors import FORMAT_VERSION
from .safetensors import parse_json as strict_json
from .validation import (
    MAX_MANIFEST_BYTES,
    MAX_REPORT_BYTES,
    FormatViolation,
    parse_json,
    read_bounded,
    validate_manifest_doc,
    validate_report,
)

log = logging.getLogger("megatron_ext.engine")


log = logging.getLogger("megatron_ext.engine")


def encode_json(doc: dict) -> bytes:
    """Reports and manifests as compact JSON: json's C encoder (an indented dump runs in Python,
    three times the CPU; rank 0 writes a manifest of every rank's files each iteration)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def summary_of(report: dict, data: bytes, rel: str) -> dict:
    """What the manifest keeps of one rank's report (``data``, its bytes as written to ``rel``):
    the report's size and checksum, and its files without their tensors."""
    if type(report) is not dict or type(report.get("files")) is not list:
        raise CheckpointError(f"{rel}: not a rank report")
    files = []
    for entry in report["files"]:
        if type(entry) is not dict:
            raise CheckpointError(f"{rel}: a file entry is not an object")
        files.append({k: v for k, v in entry.items() if k != "tensors"})
    return {"rank": report.get("rank"), "version": report.get("version"),
            "report": {"file": rel, "size": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)},
            "files": files}


def summarize_report(report_bytes: bytes, rel: str) -> dict:
    """``summary_of`` a serialized report (read back from disk)."""
    return summary_of(parse_json(report_bytes, rel), report_bytes, rel)


#: The parts of a manifest each rank encodes for itself (``manifest_part``) and rank 0 joins.
MANIFEST_SHARES = ("files", "reports")


def manifest_part(summary: dict) -> tuple[list, dict[str, bytes]]:
    """One rank's share of the manifest, encoded by that rank: ``(head, shares)``.

    ``shares`` holds the rank's members of the manifest's ``files`` and ``reports`` objects as
    compact JSON, each led by a comma, so the ranks' shares joined in any order (and the first
    comma dropped) are those objects' bodies: rank 0 joins N shares instead of decoding and
    re-encoding N summaries. ``head``, ``[version, bytes, *file names]``, is what rank 0 checks.
    """
    rank = summary["rank"]
    files = b"".join(b"," + encode_json(entry["name"]) + b":" + encode_json(dict(entry, rank=rank))
                     for entry in summary["files"])
    head = [summary["version"], sum(e["size"] + e["state_size"] for e in summary["files"]),
            *(e["name"] for e in summary["files"])]
    return head, {"files": files, "reports": b',"%d":%s' % (rank, encode_json(summary["report"]))}


def assemble_manifest(checkpoint: str, run_id: str, version: int | None, world_size: int, heads: list[list],
                      shares: dict[str, bytes], attempt_of: str | None = None) -> tuple[dict, bytes]:
    """The format-2 manifest from every rank's ``manifest_part``: ``(header, bytes)``.

    ``heads``: ``[rank, *head]`` of every rank, in rank order; ``shares``: for each of
    ``MANIFEST_SHARES``, every rank's share joined. ``header`` is the manifest without ``files``
    and ``reports``. Rank 0's cost: a few C-speed passes over N small heads, no share decoded.
    """
    if len(heads) != world_size:
        raise CheckpointError(f"checkpoint {checkpoint}: {len(heads)} rank summaries for world size {world_size}")
    ranks = [head[0] for head in heads]
    if ranks != list(range(world_size)):
        rank = next(r for r, got in enumerate(ranks) if got != r)
        raise CheckpointError(f"checkpoint {checkpoint}: summary {rank} is of rank {ranks[rank]!r}")
    names = [name for head in heads for name in head[3:]]
    if len(set(names)) != len(names):
        owner: dict[str, int] = {}
        for head in heads:
            for name in head[3:]:
                if owner.setdefault(name, head[0]) != head[0]:
                    raise CheckpointError(f"checkpoint {checkpoint}: file name {name!r} saved by ranks {owner[name]} "
                                          f"and {head[0]}; names must be unique per checkpoint")
    # A rank that saved nothing only joins the commit (``commit`` takes no version): it states none.
    versions = {head[1] for head in heads if len(head) > 3}
    if len(versions) > 1:
        raise CheckpointError(f"checkpoint {checkpoint}: ranks disagree on the version {sorted(map(str, versions))}")
    if versions:
        version = versions.pop()
    header = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": run_id, "checkpoint": checkpoint,
        "version": version, "world_size": world_size, "committed_at": time.time(),
    }
    if attempt_of is not None:
        header["attempt_of"] = attempt_of
    data = b"".join((encode_json(header)[:-1], b',"files":{', shares["files"][1:], b'},"reports":{',
                     shares["reports"][1:], b"}}"))
    return header, data


def build_manifest(checkpoint: str, run_id: str, version: int | None, world_size: int, summaries: list[dict],
                   attempt_of: str | None = None) -> dict:
    """The manifest ``assemble_manifest`` writes for these summaries, as a dict (for tools and tests)."""
    heads, shares = [], {name: b"" for name in MANIFEST_SHARES}
    for summary in summaries:
        head, share = manifest_part(summary)
        heads.append([summary["rank"], *head])
        for name in MANIFEST_SHARES:
            shares[name] += share[name]
    _, data = assemble_manifest(checkpoint, run_id, version, world_size, heads, shares, attempt_of)
    return parse_json(data, f"{checkpoint}/{MANIFEST}")


def check_assembled(checkpoint: str, data: bytes, heads: list[list], shares: dict[str, bytes],
                    where: str) -> dict:
    """Rank 0, before the manifest counts: ``data`` (what ``assemble_manifest`` joined) validated
    exactly as ``read_manifest`` will read it back, and every file entry held to the rank that
    announced it in its head. Returns the parsed manifest.

    The shares were encoded by the ranks and joined without being read; one that a bug, a bit
    flip in the store or a stranger on a reused port damaged would otherwise commit a checkpoint
    no loader accepts, and retention would then delete the last good one. A failure is a
    ``CheckpointError`` naming the rank whose share broke the rule.
    """
    owner = {name: head[0] for head in heads for name in head[3:]}
    try:
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatViolation(f"{len(data)} bytes, more than a manifest may have ({MAX_MANIFEST_BYTES})")
        try:
            doc = strict_json(data)
        except ValueError as exc:
            raise FormatViolation(str(exc), rank=_unparsable_share(shares, owner)) from None
        validate_manifest_doc(doc, checkpoint)
        for name, entry in doc["files"].items():
            if owner.get(name) != entry["rank"]:
                raise FormatViolation(f"file {name!r} is listed as rank {entry['rank']}'s, but "
                               + (f"rank {owner[name]} saved it" if name in owner else "no rank saved it"), file=name)
        if len(doc["files"]) != len(owner):
            lacking = next(name for name in owner if name not in doc["files"])
            raise FormatViolation(f"file {lacking!r}, which rank {owner[lacking]} saved, is not listed", file=lacking)
    except FormatViolation as exc:
        rank = exc.rank if exc.rank is not None else owner.get(exc.file)
        part = f"rank {rank}'s share of it" if rank is not None else "a share no rank can be named for"
        raise CheckpointError(f"checkpoint {checkpoint}: the manifest fails validation in {part}: {exc}; "
                              f"the checkpoint is not committed ({where} not written)") from None
    return doc


def _unparsable_share(shares: dict[str, bytes], owner: dict[str, int]) -> int | None:
    """The rank whose entry in the joined shares is not JSON (only when the manifest was not)."""
    decoder = json.JSONDecoder()
    for part, raw in shares.items():
        text, pos, last = raw.decode("utf-8", "replace"), 0, None
        while pos < len(text):
            who = None
            try:
                if text[pos] != ",":
                    raise ValueError("no comma")
                key, pos = decoder.raw_decode(text, pos + 1)
                if type(key) is str:
                    who = owner.get(key) if part == "files" else (int(key) if key.isdigit() else None)
                if text[pos:pos + 1] != ":":
                    raise ValueError("no colon")
                _, pos = decoder.raw_decode(text, pos + 1)
            except ValueError:
                return who if who is not None else last  # else: the damage follows the last good entry
            last = who
    return None


class TensorIndex:
    """The per-tensor index of one committed checkpoint's files, each rank report read and checked once.

    Format 1 manifests carry the index inline. In format 2 it is in each rank's report, which is
    as untrusted as the manifest: it must be a regular file of the manifest's size and checksum,
    of this checkpoint, run and rank, repeat the manifest's entry for each of its files, and pass
    the same tensor checks format 1's inline index does. Any problem is a ``CheckpointError``
    naming the report file.
    """

    def __init__(self, checkpoint_dir: str, manifest: dict):
        self.checkpoint_dir, self.manifest = checkpoint_dir, manifest
        self._by_rank: dict[int, dict[str, dict]] = {}

    def report_path(self, rank: int) -> str:
        return os.path.join(self.checkpoint_dir, REPORTS, report_name(rank, self.manifest["run_id"]))

    def tensors(self, name: str) -> dict:
        """File ``name``'s tensors: name -> {dtype, shape, offsets, xxh3_64}."""
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.manifest['checkpoint']} has no file {name!r}")
        if self.manifest["format_version"] == 1:
            return entry["tensors"]
        return self.rank_tensors(entry["rank"])[name]

    def entry(self, name: str) -> dict:
        """File ``name``'s manifest entry with its ``tensors``, as format 1 inlines it."""
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.manifest['checkpoint']} has no file {name!r}")
        return entry if "tensors" in entry else dict(entry, tensors=self.tensors(name))

    def rank_tensors(self, rank: int) -> dict[str, dict]:
        """Every file of ``rank``: name -> tensors (format 2: read and checked on first use)."""
        if rank not in self._by_rank:
            if self.manifest["format_version"] == 1:
                self._by_rank[rank] = {n: e["tensors"] for n, e in self.manifest["files"].items() if e["rank"] == rank}
            else:
                self._by_rank[rank] = self._read_report(rank)
        return self._by_rank[rank]

    def _read_report(self, rank: int) -> dict[str, dict]:
        m = self.manifest
        listed = m["reports"][str(rank)]
        path = self.report_path(rank)
        raw = read_bounded(path, MAX_REPORT_BYTES, exact=listed["size"])
        if xxhash.xxh3_64_hexdigest(raw) != listed["xxh3_64"]:
            raise CheckpointError(f"{path}: checksum mismatch (xxh3-64): the bytes changed")
        report = parse_json(raw, path)
        try:
            return validate_report(report, m, rank)
        except FormatViolation as exc:
            raise CheckpointError(f"{path}: {exc}") from None


def file_tensors(checkpoint_dir: str, manifest: dict, name: str) -> dict:
    """File ``name``'s tensor index from a validated manifest of either format.

    One-off: each call reads the rank's report again; callers that read several files keep a ``TensorIndex``.
    """
    return TensorIndex(checkpoint_dir, manifest).tensors(name)

