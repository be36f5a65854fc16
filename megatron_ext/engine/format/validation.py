"""Validation of everything a checkpoint's documents claim, before any of it is used: the manifest,
each rank report, each tensor file's header against its index, and every number bounded
(docs/FORMAT.md). A broken rule is one ``CheckpointError`` naming the file."""

from __future__ import annotations

import errno
import math
import os
import re
from typing import Any

from ..errors import CheckpointError
from .. import object_store
from ..files import open_regular
from ..object_store import is_object_url
from .entries import ListedFile
from .names import FORMAT_NAME, REPORTS, RUN_ID, report_name, valid_name
from .tensor_file import INT64_MAX, TORCH_DTYPES, SafetensorsHeader, read_header, shape_elements
from .version import FORMAT_VERSION
from .strict_json import parse_json as strict_json

_HASH = re.compile(r"[0-9a-f]{16}")


#: Bounds on the JSON documents of a checkpoint, checked against the manifest's claims and each
#: file's real size before a byte is read (a claim of 2**63 bytes must not reach ``read``).
MAX_MANIFEST_BYTES = 1 << 30


MAX_REPORT_BYTES = 1 << 30


MAX_SIDECAR_BYTES = 1 << 30


class FormatViolation(Exception):
    """A rule broken; ``file`` / ``rank``: the file entry or rank report it is in, when it is in one."""

    def __init__(self, message: str, file: str | None = None, rank: int | None = None):
        super().__init__(message)
        self.file, self.rank = file, rank


def read_bounded(path: str, limit: int, exact: int | None = None, missing_ok: bool = False) -> bytes | None:
    """A regular file's bytes (never through a symlink), its real size held to ``exact`` (a
    manifest's claim) or at most ``limit`` before anything is read; None if missing and ``missing_ok``.
    On the object-store level the same, from the object (its length checked before its bytes are read)."""
    if is_object_url(path):
        return _read_object_bounded(path, limit, exact, missing_ok)
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


def _read_object_bounded(url: str, limit: int, exact: int | None, missing_ok: bool) -> bytes | None:
    try:
        raw = object_store.get(url, max_bytes=limit if exact is None else max(exact, 0))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise CheckpointError(f"{url}: missing") from None
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise CheckpointError(f"{url}: larger than {limit if exact is None else exact} bytes"
                                  + ("" if exact is None else " (the manifest's size)")) from None
        raise CheckpointError(f"{url}: cannot be read: {exc.strerror or exc}") from None
    if exact is not None and len(raw) != exact:
        raise CheckpointError(f"{url}: has {len(raw)} bytes, the manifest says {exact}")
    if len(raw) > limit:
        raise CheckpointError(f"{url}: larger than {limit} bytes")
    return raw


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON (``strict_json.parse_json``); errors are ``CheckpointError`` naming ``where``."""
    try:
        return strict_json(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def validate_manifest(doc: Any, checkpoint: str, where: str) -> dict:
    """``doc`` if it is a well-formed manifest of checkpoint ``checkpoint``, else ``CheckpointError``."""
    try:
        validate_manifest_doc(doc, checkpoint)
    except FormatViolation as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return doc


def validate_manifest_doc(doc: Any, checkpoint: str) -> None:
    version = validate_header(doc, checkpoint)
    world, run_id = doc["world_size"], doc["run_id"]
    if version >= 2:
        _validate_reports(doc.get("reports"), checkpoint, run_id, world)
    elif "reports" in doc:
        raise FormatViolation("reports are not part of format 1")
    files = doc.get("files")
    if type(files) is not dict:
        raise FormatViolation("files is not an object")
    paths: set[str] = set()
    for name, entry in files.items():
        try:
            _validate_file(name, entry, checkpoint, world, paths, inline=version == 1)
        except FormatViolation as exc:
            raise FormatViolation(f"file {name!r}: {exc}", file=name) from None


def validate_header(doc: Any, checkpoint: str) -> int:
    """The manifest's fields besides ``files`` and ``reports`` (what rank 0 itself writes);
    returns the format version."""
    if type(doc) is not dict:
        raise FormatViolation("not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise FormatViolation(f"not a {FORMAT_NAME} manifest (format {doc.get('format')!r})")
    version = doc.get("format_version")
    if not _is_int(version) or version < 1:
        raise FormatViolation(f"format_version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise FormatViolation(f"written by a newer format (version {version}; this reader knows {FORMAT_VERSION})")
    run_id = doc.get("run_id")
    if type(run_id) is not str or not RUN_ID.fullmatch(run_id):
        raise FormatViolation(f"run_id {run_id!r} is not 12 hex digits")
    attempt_of = doc.get("attempt_of")
    if attempt_of is not None and (type(attempt_of) is not str or not RUN_ID.fullmatch(attempt_of)):
        raise FormatViolation(f"attempt_of {attempt_of!r} is not 12 hex digits")
    if doc.get("checkpoint") != checkpoint:
        raise FormatViolation(f"belongs to checkpoint {doc.get('checkpoint')!r}, not to its directory {checkpoint!r} "
                       "(a copied or moved checkpoint keeps its original name)")
    if doc.get("version") is not None and not (_is_int(doc.get("version")) and abs(doc["version"]) <= INT64_MAX):
        raise FormatViolation(f"version {doc.get('version')!r} is not a whole number (an int64)")
    world = doc.get("world_size")
    if not _is_int(world) or not 1 <= world <= INT64_MAX:
        raise FormatViolation(f"world_size {world!r} is not a whole number >= 1")
    committed_at = doc.get("committed_at")
    if not _is_number(committed_at):
        raise FormatViolation(f"committed_at {committed_at!r} is not a time")
    return version


def _validate_reports(reports: Any, checkpoint: str, run_id: str, world: int) -> None:
    """Format 2: one report per rank, named for that rank and this run, with its size and checksum."""
    if type(reports) is not dict:
        raise FormatViolation("reports is not an object")
    # Counted before any set of ranks is built: a world_size of 2**62 must not be enumerated.
    if len(reports) != world or set(reports) != {str(r) for r in range(world)}:
        missing = next((r for r in range(min(world, len(reports) + 1)) if str(r) not in reports), None)
        raise FormatViolation(f"reports must list exactly ranks 0..{world - 1}", rank=missing)
    for rank in range(world):
        validate_report_entry(reports[str(rank)], rank, checkpoint, run_id)


def validate_report_entry(entry: Any, rank: int, checkpoint: str, run_id: str) -> None:
    """The manifest's record of one rank's report: its file, size and checksum."""
    want = f"{checkpoint}/{REPORTS}/{report_name(rank, run_id)}"
    if type(entry) is not dict or entry.get("file") != want:
        raise FormatViolation(f"report of rank {rank} is not an object naming {want!r}", rank=rank)
    if not _is_int(entry.get("size")) or not 2 <= entry["size"] <= MAX_REPORT_BYTES:
        raise FormatViolation(f"report of rank {rank}: size {entry.get('size')!r} is not a report size "
                       f"(2 to {MAX_REPORT_BYTES} bytes)", rank=rank)
    if type(entry.get("xxh3_64")) is not str or not _HASH.fullmatch(entry["xxh3_64"]):
        raise FormatViolation(f"report of rank {rank}: xxh3_64 {entry.get('xxh3_64')!r} is not an xxh3-64 checksum",
                       rank=rank)


def validate_file_entry(name: str, entry: Any, checkpoint: str, world: int, paths: set[str]) -> None:
    """One format-2 ``files`` entry (no ``tensors``); ``paths`` collects its paths, each refused if seen."""
    _validate_file(name, entry, checkpoint, world, paths, inline=False)


def _validate_file(name: str, entry: Any, checkpoint: str, world: int, paths: set[str], inline: bool = True) -> None:
    if not valid_name(name):
        raise FormatViolation("not a valid file name")
    if type(entry) is not dict or entry.get("name") != name:
        raise FormatViolation("its entry is not an object naming it")
    rank = entry.get("rank")
    if not _is_int(rank) or not 0 <= rank < world:
        raise FormatViolation(f"rank {rank!r} is outside world size {world}")
    for key in ("tensor_file", "state_file"):
        rel = entry.get(key)
        parts = rel.split("/") if type(rel) is str else []
        if len(parts) != 2 or parts[0] != checkpoint or not valid_name(parts[1]):
            raise FormatViolation(f"{key} {rel!r} is not <checkpoint>/<file name> inside {checkpoint}")
        if rel in paths:
            raise FormatViolation(f"{key} {rel!r} is listed twice")
        paths.add(rel)
    size, state_size = entry.get("size"), entry.get("state_size")
    if not _is_int(size) or not 8 <= size <= INT64_MAX:
        raise FormatViolation(f"size {size!r} is not a safetensors file size")
    if not _is_int(state_size) or not 0 <= state_size <= MAX_SIDECAR_BYTES:
        raise FormatViolation(f"state_size {state_size!r} is not a size (at most {MAX_SIDECAR_BYTES} bytes)")
    for key in ("xxh3_64", "state_xxh3_64"):
        if type(entry.get(key)) is not str or not _HASH.fullmatch(entry[key]):
            raise FormatViolation(f"{key} {entry.get(key)!r} is not an xxh3-64 checksum")
    if inline:
        _validate_tensors(entry.get("tensors"), size)
    elif "tensors" in entry:
        raise FormatViolation("lists tensors, which format 2 keeps in the rank's report")


def _validate_tensors(tensors: Any, size: int) -> None:
    """A file's tensor index: known dtypes, lengths that match shapes, disjoint spans inside ``size`` bytes.

    Every rank's committer runs this on its own report at every checkpoint, holding the GIL, so the
    loop keeps to plain comparisons (no generator or call per tensor but the shape's and the checksum's)."""
    if type(tensors) is not dict:
        raise FormatViolation("tensors is not an object")
    spans = []
    dtypes, is_checksum = TORCH_DTYPES, _HASH.fullmatch
    for tensor, meta in tensors.items():
        if not tensor or tensor == "__metadata__":
            raise FormatViolation(f"tensor name {tensor!r} is reserved")
        if type(meta) is not dict:
            raise FormatViolation(f"tensor {tensor!r}: not an object")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("offsets")
        if dtype not in dtypes:
            raise FormatViolation(f"tensor {tensor!r}: unknown dtype {dtype!r}")
        itemsize = dtypes[dtype].itemsize
        try:
            elements = shape_elements(shape, itemsize)
        except ValueError as exc:
            raise FormatViolation(f"tensor {tensor!r}: {exc}") from None
        if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
            raise FormatViolation(f"tensor {tensor!r}: offsets {offsets!r} are not [begin, end]")
        begin, end = offsets
        if not 8 <= begin <= end <= size:
            raise FormatViolation(f"tensor {tensor!r}: offsets {offsets} lie outside the file's {size} bytes")
        if end - begin != elements * itemsize:
            raise FormatViolation(f"tensor {tensor!r}: {end - begin} bytes do not hold shape {shape} of {dtype}")
        checksum = meta.get("xxh3_64")
        if type(checksum) is not str or not is_checksum(checksum):
            raise FormatViolation(f"tensor {tensor!r}: xxh3_64 {checksum!r} is not a checksum")
        spans.append((begin, end, tensor))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise FormatViolation(f"tensors {first!r} and {second!r} overlap")


def validate_report(report: Any, manifest: dict, rank: int) -> dict[str, dict]:
    if type(report) is not dict or report.get("format") != FORMAT_NAME:
        raise FormatViolation(f"not a {FORMAT_NAME} rank report")
    version = report.get("format_version")
    if not _is_int(version) or not 1 <= version <= FORMAT_VERSION:
        raise FormatViolation(f"format_version {version!r} is not one this reader knows")
    for key, want in (("run_id", manifest["run_id"]), ("rank", rank), ("checkpoint", manifest["checkpoint"]),
                      ("world_size", manifest["world_size"]), ("version", manifest.get("version"))):
        if report.get(key) != want or type(report.get(key)) is not type(want):
            raise FormatViolation(f"{key} {report.get(key)!r} is not the manifest's {want!r}")
    files = report.get("files")
    if type(files) is not list:
        raise FormatViolation("files is not a list")
    expected = {n: e for n, e in manifest["files"].items() if e["rank"] == rank}
    found: dict[str, dict] = {}
    for entry in files:
        name = entry.get("name") if type(entry) is dict else None
        if name not in expected or name in found:
            raise FormatViolation(f"lists file {name!r}, which the manifest does not list once for rank {rank}")
        listed = {k: v for k, v in expected[name].items() if k != "rank"}
        if {k: v for k, v in entry.items() if k != "tensors"} != listed:
            raise FormatViolation(f"file {name!r}: its entry differs from the manifest's")
        try:
            _validate_tensors(entry.get("tensors"), listed["size"])
        except FormatViolation as exc:
            raise FormatViolation(f"file {name!r}: {exc}") from None
        found[name] = entry["tensors"]
    if len(found) != len(expected):
        raise FormatViolation(f"lacks files {sorted(set(expected) - set(found))[:3]} the manifest lists for rank {rank}")
    return found


def check_report(report: dict, rank: int) -> None:
    """A rank, before it says its files are durable: its report (the tensor index rank 0 never
    reads) must pass the rules ``TensorIndex`` applies at load, against the entries its own share
    of the manifest repeats; a report no loader would accept fails its commit instead."""
    checkpoint = report.get("checkpoint")
    try:
        if type(report.get("files")) is not list:
            raise FormatViolation("files is not a list")
        listed, paths = {}, set()
        for entry in report["files"]:
            name = entry.get("name") if type(entry) is dict else None
            listed[name] = dict({k: v for k, v in entry.items() if k != "tensors"}, rank=rank) if name else entry
            try:
                _validate_file(name, listed[name], checkpoint, report.get("world_size"), paths, inline=False)
            except FormatViolation as exc:
                raise FormatViolation(f"file {name!r}: {exc}") from None
        validate_report(report, {"run_id": report.get("run_id"), "checkpoint": checkpoint, "files": listed,
                                  "world_size": report.get("world_size"), "version": report.get("version")}, rank)
    except (FormatViolation, TypeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: rank {rank}'s report would not load: {exc}") from None


def read_listed_header(fd: int, file: ListedFile, run_id: str | None, where: str) -> SafetensorsHeader:
    """The open tensor file ``fd`` against the manifest: its size, its safetensors header parsed and (with
    ``run_id``) describing exactly the listed tensors of that run. What a load and ``verify`` both check."""
    size = os.fstat(fd).st_size
    if size != file.file.size:
        raise CheckpointError(f"{where}: has {size} bytes, the manifest says {file.file.size}")
    try:
        header = read_header(fd, size)
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{where}: bad safetensors header: {exc}") from None
    if run_id is not None:
        check_tensor_file(file, header, run_id, where)
    return header


def check_tensor_file(file: ListedFile, header: SafetensorsHeader, run_id: str, where: str) -> None:
    """The file's safetensors header must describe exactly the manifest's tensors (and its run)."""
    if header.metadata.get("run_id") != run_id:
        raise CheckpointError(f"{where}: written by run {header.metadata.get('run_id')}, the manifest is of run {run_id}")
    if header.size != file.file.size:
        raise CheckpointError(f"{where}: the header describes {header.size} bytes, the manifest {file.file.size}")
    listed = file.tensors
    if set(header.tensors) != set(listed):
        extra = sorted(set(header.tensors) - set(listed))[:3]
        lacking = sorted(set(listed) - set(header.tensors))[:3]
        raise CheckpointError(f"{where}: its tensors differ from the manifest's (only in the file: {extra}, "
                              f"only in the manifest: {lacking})")
    for name, (dtype, shape, begin, end) in header.tensors.items():
        meta = listed[name]
        if (TORCH_DTYPES.get(dtype), tuple(shape), begin, end) != (meta.dtype, meta.shape, meta.begin, meta.end):
            raise CheckpointError(f"{where}: tensor {name!r} is {dtype}{shape} at {[begin, end]} in the file, "
                                  f"{meta.saved_as} at {[meta.begin, meta.end]} in the manifest")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
