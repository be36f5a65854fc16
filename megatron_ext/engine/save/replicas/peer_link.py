"""The transport of peer replicas: paired point-to-point transfers of file bundles on one process group.

Every rank commits the same checkpoints in the same order, so each replication (and each
recovery) is one paired exchange: send a bundle to the holder while receiving one from the
source, chunk by chunk, every wait bounded by ``persist_timeout_s``. A received file's name comes
from a peer and is checked before anything is written; its size and checksum are returned for
the caller to judge (``mismatch``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Iterable, Iterator

import torch

from ...errors import CheckpointError
from ...files import private_dir
from ...format.digest import FileDigest, valid_cuts
from ...format.names import valid_name


@dataclasses.dataclass(frozen=True)
class BundleFile:
    """One file of a bundle: its path relative to the checkpoints' root (``<checkpoint>/<name>``), its
    size and xxh3-64, and for a tensor file the pieces its checksum is made of (format/digest.py)."""

    rel: str
    size: int
    xxh3_64: str | None
    cuts: tuple[int, ...] | None = None

    def wire(self) -> dict:
        doc = {"rel": self.rel, "size": self.size, "xxh3_64": self.xxh3_64}
        if self.cuts is not None:
            doc["cuts"] = list(self.cuts)
        return doc

    @classmethod
    def from_wire(cls, doc: Any) -> "BundleFile":
        """From a peer's (or the replica directory's) JSON, checked before anything is written: a name
        as a validated manifest has them, a size, and well-formed pieces; else a ``CheckpointError``."""
        rel = doc.get("rel") if type(doc) is dict else None
        parts = rel.split("/") if type(rel) is str else []
        if len(parts) != 2 or not all(valid_name(p) for p in parts):
            raise CheckpointError(f"a peer sent a replica file named {rel!r}; refused")
        size, digest, cuts = doc.get("size"), doc.get("xxh3_64"), doc.get("cuts")
        if type(size) is not int or size < 0 or not (digest is None or type(digest) is str):
            raise CheckpointError(f"a peer sent replica file {rel} with a malformed size or checksum; refused")
        if cuts is not None and not valid_cuts(cuts, size):
            raise CheckpointError(f"a peer sent replica file {rel} with malformed checksum pieces; refused")
        return cls(rel, size, digest, tuple(cuts) if cuts is not None else None)


@dataclasses.dataclass(frozen=True)
class BundleMeta:
    """What a bundle says of itself: the checkpoint and run its files are of, or why the holder offers
    none (``unusable``); ``received_at`` is the holder's, once it keeps the replica."""

    files: tuple[BundleFile, ...] = ()
    checkpoint: str | None = None
    version: int | None = None
    run_id: str | None = None
    unusable: str | None = None
    received_at: float | None = None

    def wire(self) -> dict:
        doc: dict[str, Any] = {"files": [f.wire() for f in self.files]}
        for key in ("checkpoint", "version", "run_id", "unusable", "received_at"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return doc

    @classmethod
    def from_wire(cls, doc: Any) -> "BundleMeta":
        if type(doc) is not dict or type(doc.get("files", [])) is not list:
            raise CheckpointError("a peer sent replica metadata that is not a bundle; refused")
        text = {k: doc.get(k) for k in ("checkpoint", "run_id", "unusable")}
        if not all(v is None or type(v) is str for v in text.values()):
            raise CheckpointError("a peer sent replica metadata with a malformed name; refused")
        version, received = doc.get("version"), doc.get("received_at")
        return cls(tuple(BundleFile.from_wire(f) for f in doc.get("files", [])), text["checkpoint"],
                   version if type(version) is int else None, text["run_id"], text["unusable"],
                   received if type(received) in (int, float) else None)


@dataclasses.dataclass
class Bundle:
    """What one rank sends in one exchange: its metadata, then ``meta.files`` read from ``base``."""

    meta: BundleMeta
    base: str | None = None


def _chunks(files: tuple[BundleFile, ...], chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(file index, offset, length) of every chunk, file after file."""
    for i, f in enumerate(files):
        offset = 0
        while offset < f.size:
            n = min(chunk_bytes, f.size - offset)
            yield i, offset, n
            offset += n


class PeerLink:
    """Paired point-to-point transfers on the replication group: send one bundle, receive one."""

    def __init__(self, group: Any, chunk_bytes: int, timeout_s: float):
        self.group = group
        self.chunk_bytes = chunk_bytes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._send_buf = torch.empty(chunk_bytes, dtype=torch.uint8)
        self._recv_buf = torch.empty(chunk_bytes, dtype=torch.uint8)

    def _pair(self, send_to: int | None, out: torch.Tensor | None, recv_from: int | None,
              into: torch.Tensor | None) -> None:
        import torch.distributed as dist

        works = []
        if out is not None:
            works.append(dist.isend(out, send_to, group=self.group))
        if into is not None:
            works.append(dist.irecv(into, recv_from, group=self.group))
        for work in works:
            work.wait(self.timeout)

    def exchange(self, send_to: int | None, outgoing: Bundle | None, recv_from: int | None,
                 dest: str | None) -> tuple[BundleMeta | None, dict[str, tuple[int, str]]]:
        """Send ``outgoing`` to ``send_to`` while receiving into ``dest`` from ``recv_from``.

        Returns the received metadata and, per received file (path relative to ``dest``), its
        size and xxh3-64 as received; judging them is the caller's business.
        """
        sending = send_to is not None
        receiving = recv_from is not None
        out_meta = json.dumps((outgoing.meta if outgoing else BundleMeta()).wire()).encode() if sending else b""
        lengths_in = torch.zeros(1, dtype=torch.int64)
        self._pair(send_to, torch.tensor([len(out_meta)], dtype=torch.int64) if sending else None,
                   recv_from, lengths_in if receiving else None)
        meta_in = torch.empty(int(lengths_in.item()), dtype=torch.uint8)
        self._pair(send_to, torch.frombuffer(bytearray(out_meta), dtype=torch.uint8) if sending else None,
                   recv_from, meta_in if receiving else None)
        meta = BundleMeta.from_wire(_json(bytes(meta_in.numpy()))) if receiving else None
        out_files = outgoing.meta.files if sending and outgoing else ()
        in_files = meta.files if meta else ()
        received: dict[str, tuple[int, str]] = {}
        sink = _Sink(dest, in_files) if in_files else None
        source = _Source(outgoing.base, out_files) if out_files else None
        try:
            sends = list(_chunks(out_files, self.chunk_bytes))
            recvs = list(_chunks(in_files, self.chunk_bytes))
            for step in range(max(len(sends), len(recvs))):
                out = into = None
                if step < len(sends):
                    i, offset, n = sends[step]
                    source.read(i, offset, memoryview(self._send_buf.numpy())[:n])
                    out = self._send_buf[:n]
                if step < len(recvs):
                    into = self._recv_buf[:recvs[step][2]]
                self._pair(send_to, out, recv_from, into)
                if into is not None:
                    i, offset, n = recvs[step]
                    sink.write(i, memoryview(self._recv_buf.numpy())[:n])
            if sink is not None:
                received = sink.finish()
        finally:
            if sink is not None:
                sink.close()
            if source is not None:
                source.close()
        return meta, received


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise CheckpointError("a peer sent replica metadata that is not JSON; refused") from None


class _Source:
    """Reads the files of an outgoing bundle in order."""

    def __init__(self, base: str, files: tuple[BundleFile, ...]):
        self.base, self.files = base, files
        self._index, self._file = -1, None

    def read(self, index: int, offset: int, view: memoryview) -> None:
        if index != self._index:
            self.close()
            path = os.path.join(self.base, self.files[index].rel)
            self._file, self._index = open(path, "rb", buffering=0), index
        self._file.seek(offset)
        got = 0
        while got < len(view):
            n = self._file.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{self._file.name} shrank while being sent to a peer")
            got += n

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Sink:
    """Writes the files of an incoming bundle under ``dest`` (a private directory), checksumming on the way
    (a tensor file in the pieces its ``cuts`` name, format/digest.py)."""

    def __init__(self, dest: str, files: tuple[BundleFile, ...]):
        # The names came from a peer and were checked as they arrived (``BundleFile.from_wire``).
        self.dest, self.files = dest, files
        self._hashes = [FileDigest(list(f.cuts) if f.cuts is not None else None) for f in files]
        self._sizes = [0] * len(files)
        self._index, self._file = -1, None
        for f in files:
            self._open(f.rel).close()  # empty files exist too

    def _open(self, rel: str):
        """A file of the bundle, for writing: its directory checked private, the file never through a link."""
        path = os.path.join(self.dest, rel)
        private_dir(os.path.dirname(path), "replica_dir", root=self.dest)
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                         "wb")

    def write(self, index: int, data: memoryview) -> None:
        if index != self._index:
            self.close()
            self._file, self._index = self._open(self.files[index].rel), index
        self._file.write(data)
        self._hashes[index].update(data)
        self._sizes[index] += len(data)

    def finish(self) -> dict[str, tuple[int, str]]:
        self.close()
        return {f.rel: (self._sizes[i], self._hashes[i].hexdigest()) for i, f in enumerate(self.files)}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def mismatch(expected: "Iterable[BundleFile]", received: dict[str, tuple[int, str]]) -> str | None:
    """Why ``received`` is not exactly the ``expected`` files (rel, size, xxh3_64), or None."""
    expected = list(expected)
    if sorted(received) != sorted(f.rel for f in expected):
        return f"it holds {sorted(received)}, not {sorted(f.rel for f in expected)}"
    for f in expected:
        size, digest = received[f.rel]
        if size != f.size:
            return f"{f.rel} has {size} bytes, expected {f.size}"
        if digest != f.xxh3_64:
            return f"{f.rel} fails its checksum"
    return None


__all__ = ["Bundle", "BundleFile", "BundleMeta", "PeerLink", "mismatch"]
