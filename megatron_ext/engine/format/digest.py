"""A tensor file's checksum in format 3: one xxh3-64 pass over its bytes gives the file's and every tensor's.

Formats 1 and 2 listed the xxh3-64 of the whole file and, separately, of every tensor: every byte was
hashed twice when written (docs/BENCHMARKS.md). From format 3 a tensor file's ``xxh3_64`` is the
xxh3-64 of its *pieces'* digests: the file is cut at its data start and at every tensor's end, and
the digest of each non-empty piece (the header, then each tensor with bytes, in file order) is
appended as 8 big-endian bytes. The pieces' digests are the tensors' own, so a writer or a verifier
hashes each byte once and gets both; a copy that knows the cuts checks the file in one pass too.

Only xxhash here: the I/O worker process imports it (io_ops.py).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Sequence

import xxhash

#: The format version from which a tensor file's digest is made of its pieces' digests.
PIECEWISE_FROM_VERSION = 3
#: Most cuts a copy accepts from a peer for one file: one per tensor and the data start.
MAX_CUTS = 1 << 22


def combine(piece_digests: Iterable[int]) -> str:
    """The file's digest (hex) from its non-empty pieces' xxh3-64 digests, in file order."""
    return xxhash.xxh3_64_hexdigest(b"".join(d.to_bytes(8, "big") for d in piece_digests))


def cuts_of(data_start: int, spans: Iterable[tuple[int, int]]) -> list[int]:
    """Where a tensor file's pieces end: its data start, then each tensor's end (absolute offsets)."""
    return sorted({data_start, *(end for _, end in spans)})


def tensor_file_digest(header_digest: int, tensors: Iterable[tuple[int, int, str]]) -> str:
    """The file's digest from its header's (bytes before the data) and its tensors' ``(begin, end,
    hex digest)``: what a reader that checked every tensor compares with the listed one."""
    ordered = sorted((begin, end, digest) for begin, end, digest in tensors if end > begin)
    return combine([header_digest, *(int(digest, 16) for _, _, digest in ordered)])


class FileDigest:
    """The digest of a file fed in order, in pieces cut at ``cuts`` (format 3), or, with ``cuts``
    None, the plain xxh3-64 of its bytes (a sidecar, or a tensor file of format 1 or 2)."""

    __slots__ = ("cuts", "position", "pieces", "_current", "_current_start")

    def __init__(self, cuts: Sequence[int] | None = None):
        self.cuts = None if cuts is None else list(cuts)
        self.position = 0
        self.pieces: list[tuple[int, int, int]] = []  # (start, end, digest) of each finished non-empty piece
        self._current = xxhash.xxh3_64()
        self._current_start = 0

    def update(self, data) -> None:
        """The next ``len(data)`` bytes of the file."""
        view = memoryview(data).cast("B")
        if self.cuts is None:
            self._current.update(view)
            self.position += len(view)
            return
        done = 0
        while done < len(view):
            k = bisect.bisect_right(self.cuts, self.position)  # the next cut after the position
            take = len(view) - done if k == len(self.cuts) else min(len(view) - done, self.cuts[k] - self.position)
            self._current.update(view[done:done + take])
            done += take
            self.position += take
            if k < len(self.cuts) and self.position == self.cuts[k]:
                self._close_piece()

    def _close_piece(self) -> None:
        if self.position > self._current_start:
            self.pieces.append((self._current_start, self.position, self._current.intdigest()))
            self._current = xxhash.xxh3_64()
        self._current_start = self.position

    def hexdigest(self) -> str:
        """The digest of the bytes fed so far (call once, at the end)."""
        if self.cuts is None:
            return self._current.hexdigest()
        self._close_piece()
        return combine(d for _, _, d in self.pieces)


def valid_cuts(cuts, size: int) -> bool:
    """Whether ``cuts`` (from a peer) are strictly increasing offsets within a file of ``size`` bytes."""
    if type(cuts) is not list or len(cuts) > MAX_CUTS or type(size) is not int:
        return False
    last = 0
    for cut in cuts:
        if type(cut) is not int or cut <= last or cut > size:
            return False
        last = cut
    return True


@dataclasses.dataclass(frozen=True)
class FileChecksums:
    """A written file's checksums (xxh3-64, hex), as its rank report records them: the tensor file
    (of its pieces), each tensor in file order, the sidecar (the I/O worker's ``finish`` reply)."""

    file: str
    tensors: tuple[str, ...]
    sidecar: str


__all__ = ["PIECEWISE_FROM_VERSION", "FileChecksums", "FileDigest", "combine", "cuts_of", "tensor_file_digest", "valid_cuts"]
