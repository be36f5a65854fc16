"""``verify`` is as strict as a loader about tensor files: whatever the ``safetensors`` library
rejects, ``verify`` (deep and ``--quick``) and ``load`` reject too, naming the file and the reason;
a few things the library tolerates (our writer never produces them) are rejected as well.

Each crafted header sits in a genuine checkpoint whose manifest is re-sealed to the crafted file
(its size and checksums), so a checksum is never what catches it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError
from megatron_ext.engine.read.verify import verify_checkpoint

from helpers.hostile import C2, SMALL, files_of, reseal


def _split(data: bytes) -> tuple[dict, int, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), n, data[8 + n:]


def _join(body: bytes, n: int, rest: bytes) -> bytes:
    assert len(body) <= n, "the crafted header must fit the original padding"
    return struct.pack("<Q", n) + body + b" " * (n - len(body)) + rest


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def overlap(data):
    header, n, rest = _split(data)
    first, second = _by_offset(header)[:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]
    return _join(json.dumps(header).encode(), n, rest)


def hole(data):
    header, n, rest = _split(data)
    last = _by_offset(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 8, end + 8]
    return _join(json.dumps(header).encode(), n, rest[:begin] + b"\0" * 8 + rest[begin:])


def unknown_dtype(data):
    header, n, rest = _split(data)
    header["w"]["dtype"] = "F99"
    return _join(json.dumps(header).encode(), n, rest)


def shape_disagrees_with_length(data):
    header, n, rest = _split(data)
    header["w"]["shape"] = [999]
    return _join(json.dumps(header).encode(), n, rest)


def trailing_bytes(data):
    return data + b"\0" * 8


def header_longer_than_file(data):
    return struct.pack("<Q", len(data)) + data[8:]


def header_too_large(data):
    return struct.pack("<Q", 200_000_000) + data[8:]


def metadata_not_strings(data):
    header, n, rest = _split(data)
    header["__metadata__"]["rank"] = 0
    return _join(json.dumps(header).encode(), n, rest)


def unpaired_surrogate(data):
    header, n, rest = _split(data)
    header["\ud800x"] = header.pop("w")
    return _join(json.dumps(header).encode(), n, rest)


def negative_offset(data):
    header, n, rest = _split(data)
    header["w"]["data_offsets"] = [-8, header["w"]["data_offsets"][1]]
    return _join(json.dumps(header).encode(), n, rest)


# Tolerated by safetensors 0.8.0, never written by this engine: rejected here all the same.
def leading_space(data):
    header, n, rest = _split(data)
    return _join(b" " + json.dumps(header).encode(), n, rest)


def duplicate_key(data):
    header, n, rest = _split(data)
    body = json.dumps(header).encode()
    return _join(body[:-1] + b', "w": ' + json.dumps(header["w"]).encode() + b"}", n, rest)


def unknown_field(data):
    header, n, rest = _split(data)
    header["w"]["note"] = "x"
    return _join(json.dumps(header).encode(), n, rest)


CASES = {  # craft -> (our reason, whether safetensors rejects it too)
    overlap: ("an overlap in the data", True),
    hole: ("a hole in the data", True),
    unknown_dtype: ("unknown dtype 'F99'", True),
    shape_disagrees_with_length: ("do not hold shape [999] of F32", True),
    trailing_bytes: ("the tensors end at byte", True),
    header_longer_than_file: ("does not fit the file", True),
    header_too_large: ("header length 200000000 does not fit", True),
    metadata_not_strings: ("__metadata__ must map strings to strings", True),
    unpaired_surrogate: ("unpaired surrogate", True),
    negative_offset: ("are not [begin, end]", True),
    leading_space: ("does not start with '{'", False),
    duplicate_key: ("duplicate key 'w'", False),
    unknown_field: ("needs exactly dtype, shape and data_offsets", False),
}


@pytest.mark.parametrize("craft", list(CASES), ids=lambda f: f.__name__)
def test_crafted_header_is_rejected_by_verify_and_load(genuine, craft):
    reason, library_rejects = CASES[craft]
    tensor_file, _ = files_of(genuine, C2)
    tensor_file.write_bytes(craft(tensor_file.read_bytes()))
    reseal(genuine, C2)
    library_error = None
    try:
        safetensors.torch.load_file(str(tensor_file))
    except Exception as exc:  # the library's own verdict on the same bytes
        library_error = exc
    assert (library_error is not None) == library_rejects, library_error
    for deep in (True, False):
        problems = verify_checkpoint(str(genuine), C2, deep=deep)
        assert problems and problems[0].path == str(tensor_file.relative_to(genuine)), problems
        assert reason in problems[0].what, problems[0]
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=re.escape(str(tensor_file)) + ".*" + re.escape(reason)):
            engine.load(C2, "rank00000")
        with pytest.raises(CheckpointError, match=re.escape(reason)):
            engine.open_checkpoint(C2).reader("rank00000").tensors(["b"])  # a partial read checks the header too


def test_header_that_disagrees_with_the_manifest(genuine):
    """A valid safetensors file whose tensors are not the manifest's (same bytes, another name)."""
    tensor_file, _ = files_of(genuine, C2)
    data = tensor_file.read_bytes()
    tensor_file.write_bytes(data.replace(b'"w":', b'"v":', 1))
    reseal(genuine, C2)
    assert set(safetensors.torch.load_file(str(tensor_file))) >= {"v"}
    (problem,) = verify_checkpoint(str(genuine), C2, deep=False)
    assert "its tensors differ from the manifest's (only in the file: ['v'], only in the manifest: ['w'])" in problem.what
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=r"its tensors differ from the manifest's"):
            engine.load(C2, "rank00000")


def test_verify_passes_what_the_library_and_load_accept(genuine):
    assert verify_checkpoint(str(genuine), C2) == []
    tensor_file: Path = files_of(genuine, C2)[0]
    library = safetensors.torch.load_file(str(tensor_file))
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        loaded = engine.load(C2, "rank00000")
    for name in ("w", "b", "h"):
        assert loaded[name].dtype == library[name].dtype
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), library[name].reshape(-1).view(torch.uint8))
