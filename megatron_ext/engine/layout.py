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
import json
import struct

import torch

ALIGN = 4096
FORMAT_VERSION = "1"

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


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


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclasses.dataclass
class TensorSlot:
    """One tensor's place in the file: [start, end) are absolute file offsets."""

    name: str
    tensor: torch.Tensor | None  # dropped once copied, so the caller's memory can be freed
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
    slots: list[TensorSlot]
    data_start: int
    size: int  # total file size in bytes


def plan(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> FileLayout:
    """O(number of tensors): reads shapes and dtypes only, never the data."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i][1].element_size())
    entries: dict[str, dict] = {"__metadata__": dict(metadata, format_version=FORMAT_VERSION)}
    slots: list[TensorSlot] = []
    offset = 0
    for i in order:
        name, t = tensors[i]
        nbytes = t.numel() * t.element_size()
        dtype = st_dtype(t.dtype)
        shape = list(t.shape)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        slots.append(TensorSlot(name, t, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    body = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    data_start = round_up(8 + len(body))
    body = body + b" " * (data_start - 8 - len(body))
    header = struct.pack("<Q", len(body)) + body
    for slot in slots:
        slot.start += data_start
        slot.end += data_start
    return FileLayout(header=header, slots=slots, data_start=data_start, size=data_start + offset)


def read_header(path: str) -> tuple[dict, int]:
    """Parse a safetensors header: (entries without __metadata__ folded in, data_start)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: truncated safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: implausible safetensors header length {n}")
        body = f.read(n)
        if len(body) != n:
            raise ValueError(f"{path}: truncated safetensors header")
    return json.loads(body), 8 + n
