"""Where every byte of a rank's tensor file goes (the safetensors layout), decided at save time.

The file is a plain safetensors file: an 8-byte little-endian header length, a JSON header, then
the tensors back to back with no holes. Two choices make it streamable with ``O_DIRECT``:

* the JSON header is padded with spaces so the data section starts at a multiple of 4 KiB, and
* tensors are ordered by decreasing element size, so every tensor starts at a multiple of its
  own element size. Chunk boundaries (multiples of 4 KiB) then never split an element, which lets
  a non-contiguous tensor be copied element-wise into any chunk.

The file is then one linear byte stream that the engine cuts into fixed, aligned chunks; only the
chunks need alignment, not the tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from typing import Any

import torch

from .digest import cuts_of
from .strict_json import parse_json
from .version import HEADER_FORMAT_VERSION
from ..files import round_up  # to the O_DIRECT block (files.ALIGN, 4 KiB): the header is padded to it

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
#: safetensors dtype name -> torch dtype, for the dtypes this format writes and accepts.
TORCH_DTYPES: dict[str, torch.dtype] = dict(_TORCH_DTYPES)
#: The safetensors library's own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
#: The largest int64: every size, offset, dimension and element count a reader takes from a
#: checkpoint must fit one (torch and numpy index with int64; Python's ints do not overflow).
INT64_MAX = (1 << 63) - 1
#: At most this many dimensions (numpy's limit; torch's is higher).
MAX_DIMS = 64


def st_dtype(dtype: torch.dtype) -> str:
    try:
        return _ST_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no safetensors equivalent") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {name!r}") from None


def shape_elements(shape: Any, itemsize: int = 1) -> int:
    """The element count of ``shape`` (a list of whole numbers >= 0), ``ValueError`` unless it fits.

    Every dimension, and the bytes of the shape with its zero dimensions taken as 1, must fit an
    int64: torch computes strides and numpy sizes that way, so a zero-element tensor with a
    dimension of 2**63 would pass a byte count of 0 and then fail in torch (``TypeError``). At
    most ``MAX_DIMS`` dimensions.
    """
    # Plain loops, no generators: every rank's committer checks its report's hundreds of shapes
    # on every checkpoint, holding the GIL (validation.check_report).
    if type(shape) is not list:
        raise ValueError(f"shape {shape!r} is not a list of whole numbers >= 0")
    for n in shape:
        if type(n) is not int or n < 0:
            raise ValueError(f"shape {shape!r} is not a list of whole numbers >= 0")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"shape of {len(shape)} dimensions (at most {MAX_DIMS})")
    extent = itemsize if itemsize > 1 else 1
    elements = 1
    for n in shape:
        elements *= n
        if n > 1:
            extent *= n
            if extent > INT64_MAX:
                raise ValueError(f"shape {shape} does not fit an int64 (at {itemsize} bytes an element)")
    return elements


@dataclasses.dataclass
class TensorSpan:
    """One tensor's place in the file: [start, end) are absolute file offsets (a "slot" is a cache buffer)."""

    name: str
    tensor: torch.Tensor | None  # the data (or its bytes); dropped once copied, so the caller's memory can be freed
    dtype: str
    shape: list[int]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class FileLayout:
    header: bytes  # length prefix + padded JSON: exactly data_start bytes
    spans: list[TensorSpan]  # in file order
    data_start: int
    size: int  # total file size in bytes

    def cuts(self) -> list[int]:
        """Where the file's checksum pieces end (format/digest.py): its data start and each tensor's end."""
        return cuts_of(self.data_start, ((s.start, s.end) for s in self.spans))

    def header_in(self, start: int, end: int) -> bytes:
        """The header's bytes within file range [start, end) (those at its start; none past it)."""
        return self.header[start:min(end, self.data_start)] if start < self.data_start else b""

    def spans_in(self, start: int, end: int, first: int = 0) -> tuple[list[tuple[int, int, int]], int]:
        """The tensors with bytes in file range [start, end), as ``(index, lo, hi)`` with [lo, hi) the
        file offsets of those bytes, and the first index a later range may overlap: ranges come in
        file order, so a caller passes it back as ``first`` and the whole file costs O(tensors)."""
        spans = self.spans
        while first < len(spans) and spans[first].end <= start:
            first += 1
        found = []
        k = first
        while k < len(spans) and spans[k].start < end:
            lo, hi = max(spans[k].start, start), min(spans[k].end, end)
            if hi > lo:
                found.append((k, lo, hi))
            k += 1
        return found, first


def plan(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> FileLayout:
    """O(number of tensors): reads shapes and dtypes only, never the data."""
    body = plan_body(tensors)
    return body.layout(metadata, [tensors[i][1] for i in body.order])


@dataclasses.dataclass(frozen=True)
class BodyPlan:
    """The part of a file's layout that depends on its tensors only (names, dtypes, shapes), not on
    its metadata: a save of the same tensors again (``file_plan.ReusablePlan``) lays its file out
    from this without a torch call."""

    order: tuple[int, ...]  # file order: indices into the planned tensor list
    names: tuple[str, ...]  # in file order
    dtypes: tuple[str, ...]
    shapes: tuple[list[int], ...]
    offsets: tuple[tuple[int, int], ...]  # [begin, end) within the data section
    entries_json: bytes  # the header's JSON object of the tensors (no ``__metadata__``)

    @property
    def data_bytes(self) -> int:
        return self.offsets[-1][1] if self.offsets else 0

    @functools.cached_property
    def position(self) -> list[int]:
        """Each planned tensor's place in file order (the inverse of ``order``)."""
        place = [0] * len(self.order)
        for k, i in enumerate(self.order):
            place[i] = k
        return place

    def layout(self, metadata: dict[str, str], sources: list[Any]) -> FileLayout:
        """The file's layout under ``metadata``; ``sources[k]`` is what the k-th tensor in file order is copied from."""
        head = json.dumps({"__metadata__": dict(metadata, format_version=HEADER_FORMAT_VERSION)},
                          separators=(",", ":")).encode("utf-8")
        # {"__metadata__":{...}} + {"a":...}: the same bytes json.dumps gives for the merged dict.
        body = head[:-1] + (b"," + self.entries_json[1:] if self.names else b"}")
        data_start = round_up(8 + len(body))
        header = struct.pack("<Q", data_start - 8) + body + b" " * (data_start - 8 - len(body))
        spans = [TensorSpan(name, source, dtype, shape, data_start + begin, data_start + end)
                 for name, source, dtype, shape, (begin, end)
                 in zip(self.names, sources, self.dtypes, self.shapes, self.offsets)]
        return FileLayout(header=header, spans=spans, data_start=data_start, size=data_start + self.data_bytes)


def plan_body(tensors: list[tuple[str, torch.Tensor]]) -> BodyPlan:
    """The tensors' order, entries and offsets: by decreasing element size (see the module docstring)."""
    sizes = [t.element_size() for _, t in tensors]
    order = sorted(range(len(tensors)), key=lambda i: -sizes[i])
    entries: dict[str, dict] = {}
    names, dtypes, shapes, offsets = [], [], [], []
    offset = 0
    for i in order:
        name, t = tensors[i]
        nbytes = t.numel() * sizes[i]
        dtype = st_dtype(t.dtype)
        shape = list(t.shape)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        names.append(name)
        dtypes.append(dtype)
        shapes.append(shape)
        offsets.append((offset, offset + nbytes))
        offset += nbytes
    return BodyPlan(tuple(order), tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets),
                    json.dumps(entries, separators=(",", ":")).encode("utf-8"))


@dataclasses.dataclass
class SafetensorsHeader:
    """A tensor file's header, checked as strictly as the safetensors library checks it (or more)."""

    tensors: dict[str, tuple[str, list[int], int, int]]  # name -> (dtype, shape, absolute begin, end)
    metadata: dict[str, str]
    data_start: int
    size: int  # the file size the header implies


def read_header(fd: int, file_size: int) -> SafetensorsHeader:
    """Parse and check the safetensors header of an open file; ``ValueError`` says what is wrong.

    The rules are the library's (length-prefixed UTF-8 JSON, known dtypes, byte lengths that match
    the shapes, tensors back to back from the start of the data with no hole or overlap, the file
    exactly covered) plus a few of this format's: the JSON starts with ``{``, has no duplicate
    keys, no unknown fields and no unpaired surrogates.
    """
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise ValueError(f"header length {n} does not fit the file ({file_size} bytes)")
    body = os.pread(fd, n, 8)
    if len(body) != n:
        raise ValueError("truncated header")
    if not body.startswith(b"{"):
        raise ValueError("the header does not start with '{'")
    doc = parse_json(body)
    if type(doc) is not dict:
        raise ValueError("the header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
        raise ValueError("__metadata__ must map strings to strings")
    data_start = 8 + n
    tensors: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in doc.items():
        _no_surrogates(name)
        if type(info) is not dict or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r}: needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        try:
            elements = shape_elements(shape, TORCH_DTYPES[dtype].itemsize)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
        begin, end = offsets
        if end < begin or end - begin != elements * TORCH_DTYPES[dtype].itemsize:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes at {offsets} do not hold shape {shape} of {dtype}")
        tensors[name] = (dtype, shape, data_start + begin, data_start + end)
    for key, value in metadata.items():
        _no_surrogates(key)
        _no_surrogates(value)
    position = data_start
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != position:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, not at {position}: "
                             f"{'a hole' if begin > position else 'an overlap'} in the data")
        position = end
    if position != file_size:
        raise ValueError(f"the tensors end at byte {position}, the file has {file_size}")
    return SafetensorsHeader(tensors, metadata, data_start, position)


def _no_surrogates(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{text!r} holds an unpaired surrogate") from None
