"""The manifest: a checkpoint's commit marker and the only index of its files.

Each rank encodes its share of it (``manifest_part``) and holds those exact bytes to the rules a
loader applies (``check_share``) before posting them; rank 0 joins the shares that arrived intact
(save/commit/coordination.py) and checks what spans ranks (``assemble_manifest``) before it commits.
Every reader trusts a manifest only after validation (format/validation.py, docs/FORMAT.md).

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
from itertools import chain
from operator import itemgetter
from typing import Any

import xxhash

from ..errors import CheckpointError
from .names import FORMAT_NAME, REPORTS, report_name
from .tensor_file import INT64_MAX
from .version import FORMAT_VERSION
from .strict_json import parse_json as strict_json
from .validation import (
    MAX_MANIFEST_BYTES,
    MAX_REPORT_BYTES,
    FormatViolation,
    parse_json,
    read_bounded,
    validate_file_entry,
    validate_header,
    validate_report,
    validate_report_entry,
)

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


def check_share(checkpoint: str, run_id: str, rank: int, world_size: int, head: list,
                shares: dict[str, bytes]) -> None:
    """A rank, before it posts: its share (``manifest_part``), the exact bytes it posts, held to the
    rules ``read_manifest`` applies to them, so that rank 0 need not parse the manifest it joins.

    Beyond the loader's rules: each entry is of this rank, its files are the ones ``head`` names,
    in order, and its paths are the ones the writer makes (``<checkpoint>/<name>.<run_id>.safetensors``
    and ``.state.json``), so names that rank 0 finds unique across ranks make every path unique.
    A share no loader would accept is this rank's ``CheckpointError``, posted as its failure.
    """
    try:
        if type(head) is not list or len(head) < 2:
            raise FormatViolation(f"head {str(head)[:200]} is not [version, bytes, names...]")
        version, nbytes, *names = head
        if version is not None and not (type(version) is int and abs(version) <= INT64_MAX):
            raise FormatViolation(f"version {version!r} is not a whole number (an int64)")
        if type(nbytes) is not int or nbytes < 0:
            raise FormatViolation(f"bytes {nbytes!r} is not a size")
        entries = _members(shares["files"], "files")
        if list(entries) != names:
            raise FormatViolation(f"its files {list(entries)[:3]} are not the ones its head names {names[:3]}")
        paths: set[str] = set()
        for name, entry in entries.items():
            try:
                validate_file_entry(name, entry, checkpoint, world_size, paths)
                if entry["rank"] != rank:
                    raise FormatViolation(f"its entry says rank {entry['rank']}")
                base = f"{checkpoint}/{name}.{run_id}"
                if (entry["tensor_file"], entry["state_file"]) != (base + ".safetensors", base + ".state.json"):
                    raise FormatViolation(f"paths {entry['tensor_file']!r}, {entry['state_file']!r} are not "
                                          f"{base}.safetensors and .state.json")
            except FormatViolation as exc:
                raise FormatViolation(f"file {name!r}: {exc}") from None
        listed = _members(shares["reports"], "reports")
        if list(listed) != [str(rank)]:
            raise FormatViolation(f"reports lists ranks {list(listed)[:3]}, not exactly its own")
        validate_report_entry(listed[str(rank)], rank, checkpoint, run_id)
    except FormatViolation as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: rank {rank}'s share of the manifest would not load: "
                              f"{exc}") from None


#: Bytes that frame shares in the commit store (save/commit/coordination.py). Strict JSON never holds one:
#: inside strings control characters are escaped, outside them they are not whitespace.
FRAMING_BYTES = (b"\x1e", b"\x1f")


def _members(part: Any, what: str) -> dict:
    """A share of one manifest object: empty, or comma-led members that alone make a strict JSON
    object (so any shares joined, the first comma dropped, make that object's body)."""
    if type(part) is not bytes:
        raise FormatViolation(f"its share of {what} is not bytes")
    if part == b"":
        return {}
    if part[:1] != b"," or any(byte in part for byte in FRAMING_BYTES):
        raise FormatViolation(f"its share of {what} is not comma-led JSON members")
    try:
        doc = strict_json(b"{" + part[1:] + b"}")
    except ValueError as exc:
        raise FormatViolation(f"its share of {what} is {exc}") from None
    if not doc:
        raise FormatViolation(f"its share of {what} is a lone comma")
    return doc


def summarize_heads(checkpoint: str, heads: list[list], ranks: range) -> list:
    """What rank 0 checks across the ranks ``ranks``, condensed from their heads ``[rank, version,
    bytes, *names]`` (``manifest_part``, in rank order): ``[bytes, versions, *names]``, the versions
    (distinct, in no order) of the ranks that saved files. A group's leader forwards this for its
    group (save/commit/coordination.py), so rank 0 handles one summary per group, not per rank."""
    got = list(map(itemgetter(0), heads))  # C-speed passes: this runs over every rank each commit
    if got != list(ranks):
        if len(got) != len(ranks):
            raise CheckpointError(f"checkpoint {checkpoint}: {len(got)} rank summaries for the "
                                  f"{len(ranks)} ranks {ranks.start}-{ranks.stop - 1}")
        index = next(i for i, rank in enumerate(got) if rank != ranks[i])
        raise CheckpointError(f"checkpoint {checkpoint}: summary {ranks[index]} is of rank {got[index]!r}")
    # A rank that saved nothing only joins the commit (``commit`` takes no version): it states none.
    versions = list({head[1] for head in heads if len(head) > 3})
    return [sum(map(itemgetter(2), heads)), versions, *chain.from_iterable(map(itemgetter(slice(3, None)), heads))]


def merge_summaries(checkpoint: str, summaries: list[list], groups: int) -> list:
    """One summary of every rank from the groups' ``[group, bytes, versions, *names]`` (in group order)."""
    got = list(map(itemgetter(0), summaries))
    if got != list(range(groups)):
        raise CheckpointError(f"checkpoint {checkpoint}: the summaries of groups {got[:8]} are not one per group "
                              f"of the {groups}")
    try:
        versions = list(set(chain.from_iterable(map(itemgetter(2), summaries))))
        nbytes = sum(map(itemgetter(1), summaries))
    except TypeError as exc:  # only a leader's bug: summaries arrive exactly as their leaders posted them
        raise CheckpointError(f"checkpoint {checkpoint}: a group's summary is malformed ({exc})") from None
    return [nbytes, versions, *chain.from_iterable(map(itemgetter(slice(3, None)), summaries))]


def assemble_manifest(checkpoint: str, run_id: str, version: int | None, world_size: int, summary: list,
                      shares: dict[str, list], attempt_of: str | None = None) -> tuple[dict, bytes]:
    """The format-2 manifest from every rank's ``manifest_part``: ``(header, bytes)``.

    ``summary``: every rank's heads condensed (``summarize_heads``, ``merge_summaries``), which also
    checked that each rank is in once; ``shares``: for each of ``MANIFEST_SHARES``, every rank's
    share, as pieces (bytes or views) that joined make them all. ``header`` is the manifest without
    ``files`` and ``reports``. Rank 0's cost: a few C-speed passes over the file names, no share
    decoded, and one copy of the shares' bytes, into the manifest.

    What only rank 0 can check is checked here: names unique across ranks, one version, its own
    header by the loader's rules, the size bound. With shares that each passed ``check_share`` and
    arrived intact (save/commit/coordination.py), that is every rule ``read_manifest`` applies
    (docs/FORMAT.md, "Manifest validation").
    """
    names = summary[2:]
    if len(set(names)) != len(names):
        seen: set[str] = set()
        name = next(n for n in names if n in seen or seen.add(n))
        owners = _owners(b"".join(shares["files"]), name)
        raise CheckpointError(f"checkpoint {checkpoint}: file name {name!r} saved by ranks "
                              + " and ".join(map(str, owners[:2])) + "; names must be unique per checkpoint")
    versions = summary[1]
    if len(versions) > 1:
        raise CheckpointError(f"checkpoint {checkpoint}: ranks disagree on the version {sorted(map(str, versions))}")
    if versions:
        version = versions[0]
    header = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": run_id, "checkpoint": checkpoint,
        "version": version, "world_size": world_size, "committed_at": time.time(),
    }
    if attempt_of is not None:
        header["attempt_of"] = attempt_of
    try:
        validate_header(header, checkpoint)
    except FormatViolation as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: the manifest's header would not load: {exc}") from None
    data = b"".join([encode_json(header)[:-1], b',"files":{', *_body(shares["files"]), b'},"reports":{',
                     *_body(shares["reports"]), b"}}"])
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"checkpoint {checkpoint}: a manifest of {len(data)} bytes, more than a loader "
                              f"reads ({MAX_MANIFEST_BYTES})")
    return header, data


def _body(pieces: list) -> list:
    """Comma-led members in pieces, the first comma dropped (a view, no copy): an object's body."""
    pieces = list(pieces)
    for i, piece in enumerate(pieces):
        if len(piece):
            pieces[i] = memoryview(piece)[1:]
            break
    return pieces


def _owners(files: bytes, name: str) -> list:
    """The ranks whose entries in the joined ``files`` shares are named ``name`` (for a message only)."""
    try:
        pairs = json.loads(b"{" + files[1:] + b"}", object_pairs_hook=lambda members: members)
        return [dict(entry).get("rank", "?") for key, entry in pairs if key == name]
    except (ValueError, TypeError):
        return ["?", "?"]


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
