"""The manifest: a checkpoint's commit marker and the only index of its files, validated before use.

A checkpoint directory may be damaged, copied, written by another tool or crafted, and every
reader (``load``, ``verify``, ``inspect``, ``export``, ``convert``, retention, peer-replica
recovery) trusts the manifest to say which files to open and where each tensor lies. So
``read_manifest`` checks the whole document against the format (docs/FORMAT.md) before anyone
uses it: file paths are exactly ``<checkpoint>/<basename>`` of this checkpoint and unique, every
tensor's bytes lie inside its file with a known dtype and a length that matches its shape, and the
checkpoint id is the directory's own name. ``check_tensor_file`` then holds a tensor file's own
safetensors header to the manifest, so the file and its index cannot disagree.

Format 2 keeps rank 0's work independent of the number of tensors: the manifest lists each rank's
report (the per-tensor index that rank wrote) with its size and checksum instead of inlining
every tensor. ``TensorIndex`` reads a report once, holds it to the manifest and validates its
tensors exactly as format 1's inline ones; format 1 manifests still load.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from typing import Any

import xxhash

from .fast_read import open_regular
from .jobs import CheckpointError
from .layout import (FORMAT_VERSION, INT64_MAX, TORCH_DTYPES, SafetensorsHeader, parse_json as strict_json,  # noqa: F401
                     shape_elements)  # (FORMAT_VERSION, SafetensorsHeader re-exported)

MANIFEST = "manifest.json"
FORMAT_NAME = "megatron_ext.datastates"
#: Rank reports (each rank's tensor index in format 2) live in ``<checkpoint>/.reports``.
REPORTS = ".reports"
#: Run ids: 12 lowercase hex digits (rank 0 draws them); they appear in every file name.
RUN_ID = re.compile(r"[0-9a-f]{12}")
_HASH = re.compile(r"[0-9a-f]{16}")
#: Bounds on the JSON documents of a checkpoint, checked against the manifest's claims and each
#: file's real size before a byte is read (a claim of 2**63 bytes must not reach ``read``).
MAX_MANIFEST_BYTES = 1 << 30
MAX_REPORT_BYTES = 1 << 30
MAX_SIDECAR_BYTES = 1 << 30
#: A sidecar may hold at most this many JSON values, plus ``SIDECAR_VALUES_PER_TENSOR`` for each
#: tensor of its file: parsing costs ~100 bytes of memory per value, so a 190 MB list of 10**8
#: zeros would cost gigabytes. The writer refuses what the reader would (``check_sidecar_volume``).
SIDECAR_VALUES = 1 << 22
SIDECAR_VALUES_PER_TENSOR = 64

log = logging.getLogger("megatron_ext.engine")


class _Invalid(Exception):
    """A rule broken; ``file`` / ``rank``: the file entry or rank report it is in, when it is in one."""

    def __init__(self, message: str, file: str | None = None, rank: int | None = None):
        super().__init__(message)
        self.file, self.rank = file, rank


def valid_name(name: Any) -> bool:
    """A single path component the engine may create: not empty, no '/', not hidden, no NUL, UTF-8."""
    if type(name) is not str:
        return False
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # an unpaired surrogate would become arbitrary bytes in the file name
        return False
    return 0 < size <= 255 and "/" not in name and "\0" not in name and not name.startswith(".")


def read_manifest(checkpoint_dir: str) -> dict | None:
    """The validated manifest of a committed checkpoint, or None if the directory has none.

    A manifest that is unreadable, not ours, or fails validation raises ``CheckpointError``
    naming the file and the first problem.
    """
    path = os.path.join(checkpoint_dir, MANIFEST)
    raw = read_bounded(path, MAX_MANIFEST_BYTES, missing_ok=True)
    if raw is None:
        return None
    doc = parse_json(raw, path)
    return validate_manifest(doc, os.path.basename(os.path.normpath(checkpoint_dir)), path)


def report_name(rank: int, run_id: str, error: bool = False) -> str:
    """A rank report's file name (``.error`` for a failure report)."""
    return f"rank-{rank:05d}.{run_id}{'.error' if error else ''}.json"


def read_bounded(path: str, limit: int, exact: int | None = None, missing_ok: bool = False) -> bytes | None:
    """A regular file's bytes (never through a symlink), its real size held to ``exact`` (a
    manifest's claim) or at most ``limit`` before anything is read; None if missing and ``missing_ok``."""
    fd = open_regular(path, missing_ok=missing_ok)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if exact is not None and size != exact:
            raise CheckpointError(f"{path}: has {size} bytes, the manifest says {exact}")
        if size > limit:
            raise CheckpointError(f"{path}: larger than {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(size + 1)  # one more: a file that grew since fstat is caught too
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) != size:
        raise CheckpointError(f"{path}: changed while it was being read ({len(raw)} bytes, not {size})")
    return raw


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON (``layout.parse_json``); errors are ``CheckpointError`` naming ``where``."""
    try:
        return strict_json(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def validate_manifest(doc: Any, checkpoint: str, where: str) -> dict:
    """``doc`` if it is a well-formed manifest of checkpoint ``checkpoint``, else ``CheckpointError``."""
    try:
        _validate(doc, checkpoint)
    except _Invalid as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return doc


def _validate(doc: Any, checkpoint: str) -> None:
    if type(doc) is not dict:
        raise _Invalid("not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise _Invalid(f"not a {FORMAT_NAME} manifest (format {doc.get('format')!r})")
    version = doc.get("format_version")
    if not _is_int(version) or version < 1:
        raise _Invalid(f"format_version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise _Invalid(f"written by a newer format (version {version}; this reader knows {FORMAT_VERSION})")
    run_id = doc.get("run_id")
    if type(run_id) is not str or not RUN_ID.fullmatch(run_id):
        raise _Invalid(f"run_id {run_id!r} is not 12 hex digits")
    attempt_of = doc.get("attempt_of")
    if attempt_of is not None and (type(attempt_of) is not str or not RUN_ID.fullmatch(attempt_of)):
        raise _Invalid(f"attempt_of {attempt_of!r} is not 12 hex digits")
    if doc.get("checkpoint") != checkpoint:
        raise _Invalid(f"belongs to checkpoint {doc.get('checkpoint')!r}, not to its directory {checkpoint!r} "
                       "(a copied or moved checkpoint keeps its original name)")
    if doc.get("version") is not None and not (_is_int(doc.get("version")) and abs(doc["version"]) <= INT64_MAX):
        raise _Invalid(f"version {doc.get('version')!r} is not a whole number (an int64)")
    world = doc.get("world_size")
    if not _is_int(world) or not 1 <= world <= INT64_MAX:
        raise _Invalid(f"world_size {world!r} is not a whole number >= 1")
    committed_at = doc.get("committed_at")
    if not _is_number(committed_at):
        raise _Invalid(f"committed_at {committed_at!r} is not a time")
    if version >= 2:
        _validate_reports(doc.get("reports"), checkpoint, run_id, world)
    elif "reports" in doc:
        raise _Invalid("reports are not part of format 1")
    files = doc.get("files")
    if type(files) is not dict:
        raise _Invalid("files is not an object")
    paths: set[str] = set()
    for name, entry in files.items():
        try:
            _validate_file(name, entry, checkpoint, world, paths, inline=version == 1)
        except _Invalid as exc:
            raise _Invalid(f"file {name!r}: {exc}", file=name) from None


def _validate_reports(reports: Any, checkpoint: str, run_id: str, world: int) -> None:
    """Format 2: one report per rank, named for that rank and this run, with its size and checksum."""
    if type(reports) is not dict:
        raise _Invalid("reports is not an object")
    # Counted before any set of ranks is built: a world_size of 2**62 must not be enumerated.
    if len(reports) != world or set(reports) != {str(r) for r in range(world)}:
        missing = next((r for r in range(min(world, len(reports) + 1)) if str(r) not in reports), None)
        raise _Invalid(f"reports must list exactly ranks 0..{world - 1}", rank=missing)
    for rank in range(world):
        entry = reports[str(rank)]
        want = f"{checkpoint}/{REPORTS}/{report_name(rank, run_id)}"
        if type(entry) is not dict or entry.get("file") != want:
            raise _Invalid(f"report of rank {rank} is not an object naming {want!r}", rank=rank)
        if not _is_int(entry.get("size")) or not 2 <= entry["size"] <= MAX_REPORT_BYTES:
            raise _Invalid(f"report of rank {rank}: size {entry.get('size')!r} is not a report size "
                           f"(2 to {MAX_REPORT_BYTES} bytes)", rank=rank)
        if type(entry.get("xxh3_64")) is not str or not _HASH.fullmatch(entry["xxh3_64"]):
            raise _Invalid(f"report of rank {rank}: xxh3_64 {entry.get('xxh3_64')!r} is not an xxh3-64 checksum",
                           rank=rank)


def _validate_file(name: str, entry: Any, checkpoint: str, world: int, paths: set[str], inline: bool = True) -> None:
    if not valid_name(name):
        raise _Invalid("not a valid file name")
    if type(entry) is not dict or entry.get("name") != name:
        raise _Invalid("its entry is not an object naming it")
    rank = entry.get("rank")
    if not _is_int(rank) or not 0 <= rank < world:
        raise _Invalid(f"rank {rank!r} is outside world size {world}")
    for key in ("tensor_file", "state_file"):
        rel = entry.get(key)
        parts = rel.split("/") if type(rel) is str else []
        if len(parts) != 2 or parts[0] != checkpoint or not valid_name(parts[1]):
            raise _Invalid(f"{key} {rel!r} is not <checkpoint>/<file name> inside {checkpoint}")
        if rel in paths:
            raise _Invalid(f"{key} {rel!r} is listed twice")
        paths.add(rel)
    size, state_size = entry.get("size"), entry.get("state_size")
    if not _is_int(size) or not 8 <= size <= INT64_MAX:
        raise _Invalid(f"size {size!r} is not a safetensors file size")
    if not _is_int(state_size) or not 0 <= state_size <= MAX_SIDECAR_BYTES:
        raise _Invalid(f"state_size {state_size!r} is not a size (at most {MAX_SIDECAR_BYTES} bytes)")
    for key in ("xxh3_64", "state_xxh3_64"):
        if type(entry.get(key)) is not str or not _HASH.fullmatch(entry[key]):
            raise _Invalid(f"{key} {entry.get(key)!r} is not an xxh3-64 checksum")
    if inline:
        _validate_tensors(entry.get("tensors"), size)
    elif "tensors" in entry:
        raise _Invalid("lists tensors, which format 2 keeps in the rank's report")


def _validate_tensors(tensors: Any, size: int) -> None:
    """A file's tensor index: known dtypes, lengths that match shapes, disjoint spans inside ``size`` bytes."""
    if type(tensors) is not dict:
        raise _Invalid("tensors is not an object")
    spans = []
    for tensor, meta in tensors.items():
        if not tensor or tensor == "__metadata__":
            raise _Invalid(f"tensor name {tensor!r} is reserved")
        if type(meta) is not dict:
            raise _Invalid(f"tensor {tensor!r}: not an object")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("offsets")
        if dtype not in TORCH_DTYPES:
            raise _Invalid(f"tensor {tensor!r}: unknown dtype {dtype!r}")
        try:
            elements = shape_elements(shape, TORCH_DTYPES[dtype].itemsize)
        except ValueError as exc:
            raise _Invalid(f"tensor {tensor!r}: {exc}") from None
        if type(offsets) is not list or len(offsets) != 2 or not all(_is_int(n) for n in offsets):
            raise _Invalid(f"tensor {tensor!r}: offsets {offsets!r} are not [begin, end]")
        begin, end = offsets
        if not 8 <= begin <= end <= size:
            raise _Invalid(f"tensor {tensor!r}: offsets {offsets} lie outside the file's {size} bytes")
        if end - begin != elements * TORCH_DTYPES[dtype].itemsize:
            raise _Invalid(f"tensor {tensor!r}: {end - begin} bytes do not hold shape {shape} of {dtype}")
        if type(meta.get("xxh3_64")) is not str or not _HASH.fullmatch(meta["xxh3_64"]):
            raise _Invalid(f"tensor {tensor!r}: xxh3_64 {meta.get('xxh3_64')!r} is not a checksum")
        spans.append((begin, end, tensor))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise _Invalid(f"tensors {first!r} and {second!r} overlap")


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
    versions = {head[1] for head in heads}
    if len(versions) > 1:
        raise CheckpointError(f"checkpoint {checkpoint}: ranks disagree on the version {sorted(map(str, versions))}")
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
            raise _Invalid(f"{len(data)} bytes, more than a manifest may have ({MAX_MANIFEST_BYTES})")
        try:
            doc = strict_json(data)
        except ValueError as exc:
            raise _Invalid(str(exc), rank=_unparsable_share(shares, owner)) from None
        _validate(doc, checkpoint)
        for name, entry in doc["files"].items():
            if owner.get(name) != entry["rank"]:
                raise _Invalid(f"file {name!r} is listed as rank {entry['rank']}'s, but "
                               + (f"rank {owner[name]} saved it" if name in owner else "no rank saved it"), file=name)
        if len(doc["files"]) != len(owner):
            lacking = next(name for name in owner if name not in doc["files"])
            raise _Invalid(f"file {lacking!r}, which rank {owner[lacking]} saved, is not listed", file=lacking)
    except _Invalid as exc:
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
            return _validate_report(report, m, rank)
        except _Invalid as exc:
            raise CheckpointError(f"{path}: {exc}") from None


def _validate_report(report: Any, manifest: dict, rank: int) -> dict[str, dict]:
    if type(report) is not dict or report.get("format") != FORMAT_NAME:
        raise _Invalid(f"not a {FORMAT_NAME} rank report")
    version = report.get("format_version")
    if not _is_int(version) or not 1 <= version <= FORMAT_VERSION:
        raise _Invalid(f"format_version {version!r} is not one this reader knows")
    for key, want in (("run_id", manifest["run_id"]), ("rank", rank), ("checkpoint", manifest["checkpoint"]),
                      ("world_size", manifest["world_size"]), ("version", manifest.get("version"))):
        if report.get(key) != want or type(report.get(key)) is not type(want):
            raise _Invalid(f"{key} {report.get(key)!r} is not the manifest's {want!r}")
    files = report.get("files")
    if type(files) is not list:
        raise _Invalid("files is not a list")
    expected = {n: e for n, e in manifest["files"].items() if e["rank"] == rank}
    found: dict[str, dict] = {}
    for entry in files:
        name = entry.get("name") if type(entry) is dict else None
        if name not in expected or name in found:
            raise _Invalid(f"lists file {name!r}, which the manifest does not list once for rank {rank}")
        listed = {k: v for k, v in expected[name].items() if k != "rank"}
        if {k: v for k, v in entry.items() if k != "tensors"} != listed:
            raise _Invalid(f"file {name!r}: its entry differs from the manifest's")
        try:
            _validate_tensors(entry.get("tensors"), listed["size"])
        except _Invalid as exc:
            raise _Invalid(f"file {name!r}: {exc}") from None
        found[name] = entry["tensors"]
    if len(found) != len(expected):
        raise _Invalid(f"lacks files {sorted(set(expected) - set(found))[:3]} the manifest lists for rank {rank}")
    return found


def check_report(report: dict, rank: int) -> None:
    """A rank, before it says its files are durable: its report (the tensor index rank 0 never
    reads) must pass the rules ``TensorIndex`` applies at load, against the entries its own share
    of the manifest repeats; a report no loader would accept fails its commit instead."""
    checkpoint = report.get("checkpoint")
    try:
        if type(report.get("files")) is not list:
            raise _Invalid("files is not a list")
        listed, paths = {}, set()
        for entry in report["files"]:
            name = entry.get("name") if type(entry) is dict else None
            listed[name] = dict({k: v for k, v in entry.items() if k != "tensors"}, rank=rank) if name else entry
            try:
                _validate_file(name, listed[name], checkpoint, report.get("world_size"), paths, inline=False)
            except _Invalid as exc:
                raise _Invalid(f"file {name!r}: {exc}") from None
        _validate_report(report, {"run_id": report.get("run_id"), "checkpoint": checkpoint, "files": listed,
                                  "world_size": report.get("world_size"), "version": report.get("version")}, rank)
    except (_Invalid, TypeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: rank {rank}'s report would not load: {exc}") from None


def file_tensors(checkpoint_dir: str, manifest: dict, name: str) -> dict:
    """File ``name``'s tensor index from a validated manifest of either format.

    One-off: each call reads the rank's report again; callers that read several files keep a ``TensorIndex``.
    """
    return TensorIndex(checkpoint_dir, manifest).tensors(name)


def check_tensor_file(entry: dict, header: SafetensorsHeader, run_id: str, where: str) -> None:
    """The file's safetensors header must describe exactly the manifest's tensors (and its run)."""
    if header.metadata.get("run_id") != run_id:
        raise CheckpointError(f"{where}: written by run {header.metadata.get('run_id')}, the manifest is of run {run_id}")
    if header.size != entry["size"]:
        raise CheckpointError(f"{where}: the header describes {header.size} bytes, the manifest {entry['size']}")
    listed = entry["tensors"]
    if set(header.tensors) != set(listed):
        extra = sorted(set(header.tensors) - set(listed))[:3]
        lacking = sorted(set(listed) - set(header.tensors))[:3]
        raise CheckpointError(f"{where}: its tensors differ from the manifest's (only in the file: {extra}, "
                              f"only in the manifest: {lacking})")
    for name, (dtype, shape, begin, end) in header.tensors.items():
        meta = listed[name]
        if (dtype, shape, [begin, end]) != (meta["dtype"], meta["shape"], meta["offsets"]):
            raise CheckpointError(f"{where}: tensor {name!r} is {dtype}{shape} at {[begin, end]} in the file, "
                                  f"{meta['dtype']}{meta['shape']} at {meta['offsets']} in the manifest")


SIDECAR_FORMAT = "megatron_ext.state"


def read_sidecar(path: str, entry: dict, verify: bool = True) -> Any:
    """A sidecar's ``state`` skeleton, for ``load`` and ``verify`` alike: its real size held to the
    manifest's before it is read, its checksum (if ``verify``), then its volume before it is parsed.
    ``entry`` is the file's entry with its ``tensors`` (``TensorIndex.entry``)."""
    raw = read_bounded(path, MAX_SIDECAR_BYTES, exact=entry["state_size"])
    if verify and xxhash.xxh3_64_hexdigest(raw) != entry["state_xxh3_64"]:
        raise CheckpointError(f"{path}: checksum mismatch (xxh3-64): the bytes changed")
    check_sidecar_volume(raw, len(entry["tensors"]), path)
    return parse_sidecar(raw, path)


def parse_sidecar(raw: bytes, where: str) -> Any:
    """The ``state`` of a sidecar document ``{"format": "megatron_ext.state", "state": ...}``."""
    doc = parse_json(raw, where)
    if type(doc) is not dict or doc.get("format") != SIDECAR_FORMAT or set(doc) != {"format", "state"}:
        raise CheckpointError(f"{where}: not a {SIDECAR_FORMAT} document")
    return doc["state"]


def check_sidecar_volume(raw: bytes, tensors: int, where: str) -> None:
    """Refuse, before parsing, a sidecar over ``MAX_SIDECAR_BYTES`` or with more JSON values than ``SIDECAR_VALUES`` plus
    ``SIDECAR_VALUES_PER_TENSOR`` per tensor of its file (the writer checks the same at ``save``).

    Every value but the document itself follows a comma or opens its array or object, so counting
    those bytes (at C speed) bounds the values from above without parsing anything.
    """
    if len(raw) > MAX_SIDECAR_BYTES:
        raise CheckpointError(f"{where}: {len(raw)} bytes, more than a sidecar may have ({MAX_SIDECAR_BYTES}; "
                              "large data belongs in tensors)")
    limit = SIDECAR_VALUES + SIDECAR_VALUES_PER_TENSOR * tensors
    if len(raw) >= limit:  # no need to count: a value takes a byte, so fewer bytes hold fewer values
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
        if values > limit:
            raise CheckpointError(f"{where}: up to {values} JSON values, more than the {limit} a sidecar of "
                                  f"{tensors} tensors may hold (large data belongs in tensors)")


def run_of(manifest: dict) -> str:
    """The run that committed ``manifest``: its ``run_id``, or for a checkpoint that run saved again, ``attempt_of``.

    ``run_id`` names the attempt (its files, reports and headers carry it); a second save of the
    same checkpoint id in one run is an attempt of its own, tied to the run by ``attempt_of``.
    """
    return manifest.get("attempt_of") or manifest["run_id"]


def _identity(checkpoint_dir: str) -> tuple[int, int, int]:
    st = os.lstat(os.path.join(checkpoint_dir, MANIFEST))
    return st.st_ino, st.st_size, st.st_mtime_ns


def remember_committed(cache: dict, checkpoint_dir: str, manifest: dict) -> None:
    """Put a manifest this process has just committed into a ``list_committed`` cache, so the next
    listing does not read and validate it again (at 4,096 ranks: 1.5 MB and ~20 ms per commit)."""
    try:
        cache[checkpoint_dir] = (_identity(checkpoint_dir), manifest)
    except OSError:
        pass  # gone already: the listing will say so


def list_committed(root: str, cache: dict | None = None) -> list[tuple[str, dict]]:
    """Committed checkpoints under ``root``, oldest first (``commit_order``).

    A directory whose manifest is unreadable, another tool's, or invalid is skipped with a
    warning: one bad directory never hides the others or blocks later commits. ``cache`` (a dict
    the caller keeps) remembers validated manifests by file identity, so a caller that lists the
    same root after every commit reads and validates each manifest once.
    """
    found = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        if cache is not None:
            try:
                key = _identity(path)
            except OSError:
                continue
            hit = cache.get(path)
            if hit is not None and hit[0] == key:
                if hit[1] is not None:
                    found.append((name, hit[1]))
                continue
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            log.warning("[datastates] skipping %s: %s", path, exc)
            manifest = None
        if cache is not None:
            cache[path] = (key, manifest)
        if manifest is not None:
            found.append((name, manifest))
    found.sort(key=lambda item: commit_order(item[1]))
    return found


def commit_order(manifest: dict) -> tuple:
    """Sort key, oldest first: by version, then commit time; an unversioned checkpoint (version
    null, e.g. a one-off ``save(state, "final_export")``) is older than every versioned one, so
    ``latest()`` and retention's "newest" are always the highest version when there is one."""
    version = manifest["version"]
    return (version is not None, version if version is not None else 0, manifest["committed_at"])


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
