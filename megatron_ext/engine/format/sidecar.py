"""The sidecar: each file's non-tensor state (the codec's JSON), bounded in bytes and in values
before it is parsed."""

from __future__ import annotations

from typing import Any

import xxhash

from ..errors import CheckpointError
from .entries import ListedFile
from .validation import MAX_SIDECAR_BYTES, parse_json, read_bounded

#: A sidecar may hold at most this many JSON values, plus ``SIDECAR_VALUES_PER_TENSOR`` for each
#: tensor of its file: parsing costs ~100 bytes of memory per value, so a 190 MB list of 10**8
#: zeros would cost gigabytes. The writer refuses what the reader would (``check_sidecar_volume``).
SIDECAR_VALUES = 1 << 22


SIDECAR_VALUES_PER_TENSOR = 64


SIDECAR_FORMAT = "megatron_ext.state"


def read_sidecar(path: str, listed: ListedFile, verify: bool = True) -> Any:
    """A sidecar's ``state`` skeleton, for ``load`` and ``verify`` alike: its real size held to the
    manifest's before it is read, its checksum (if ``verify``), then its volume before it is parsed."""
    raw = read_bounded(path, MAX_SIDECAR_BYTES, exact=listed.file.state_size)
    if verify and xxhash.xxh3_64_hexdigest(raw) != listed.file.state_checksum:
        raise CheckpointError(f"{path}: checksum mismatch (xxh3-64): the bytes changed")
    check_sidecar_volume(raw, len(listed.tensors), path)
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
