"""Damaging checkpoint files in place, as a bad disk or a torn write would (no re-sealing: the
checksums in the manifest still describe the original bytes). A negative ``offset`` counts from
the end of the file."""

from __future__ import annotations

import os
from pathlib import Path


def _position(path: Path | str, offset: int) -> int:
    return offset if offset >= 0 else os.path.getsize(path) + offset


def flip_bits(path: Path | str, offset: int, mask: int = 0x01) -> None:
    """XOR the byte at ``offset`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(_position(path, offset))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ mask]))


def overwrite(path: Path | str, offset: int, data: bytes) -> None:
    """Write ``data`` over the file's bytes from ``offset`` on."""
    with open(path, "r+b") as f:
        f.seek(_position(path, offset))
        f.write(data)


def truncate_to(path: Path | str, size: int) -> None:
    """Cut the file to ``size`` bytes."""
    os.truncate(path, size)


def cut_tail(path: Path | str, nbytes: int) -> None:
    """Remove the last ``nbytes`` bytes."""
    os.truncate(path, os.path.getsize(path) - nbytes)
