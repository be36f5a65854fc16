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
from typing import Any, Iterator

import torch

from ...errors import CheckpointError
from ...files import private_dir
from ...format.digest import FileDigest, valid_cuts
from ...format.names import valid_name


@dataclasses.dataclass
class Bundle:
    """What one rank sends in one exchange: JSON metadata, then ``meta["files"]`` read from ``base``."""

    meta: dict
    base: str | None = None


def _chunks(files: list[dict], chunk_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(file index, offset, length) of every chunk, file after file."""
    for i, f in enumerate(files):
        offset = 0
        while offset < f["size"]:
            n = min(chunk_bytes, f["size"] - offset)
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
                 dest: str | None) -> tuple[dict | None, dict[str, tuple[int, str]]]:
        """Send ``outgoing`` to ``send_to`` while receiving into ``dest`` from ``recv_from``.

        Returns the received metadata and, per received file (path relative to ``dest``), its
        size and xxh3-64 as received; judging them is the caller's business.
        """
        sending = send_to is not None
        receiving = recv_from is not None
        out_meta = json.dumps(outgoing.meta if outgoing else {"files": []}).encode() if sending else b""
        lengths_in = torch.zeros(1, dtype=torch.int64)
        self._pair(send_to, torch.tensor([len(out_meta)], dtype=torch.int64) if sending else None,
                   recv_from, lengths_in if receiving else None)
        meta_in = torch.empty(int(lengths_in.item()), dtype=torch.uint8)
        self._pair(send_to, torch.frombuffer(bytearray(out_meta), dtype=torch.uint8) if sending else None,
                   recv_from, meta_in if receiving else None)
        meta = json.loads(bytes(meta_in.numpy())) if receiving else None
        out_files = outgoing.meta["files"] if sending and outgoing else []
        in_files = meta["files"] if meta else []
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


class _Source:
    """Reads the files of an outgoing bundle in order."""

    def __init__(self, base: str, files: list[dict]):
        self.base, self.files = base, files
        self._index, self._file = -1, None

    def read(self, index: int, offset: int, view: memoryview) -> None:
        if index != self._index:
            self.close()
            path = os.path.join(self.base, self.files[index]["rel"])
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

    def __init__(self, dest: str, files: list[dict]):
        for f in files:  # names come from a peer: only <checkpoint>/<basename>, as a validated manifest has them
            parts = f["rel"].split("/") if isinstance(f.get("rel"), str) else []
            if len(parts) != 2 or not all(valid_name(p) for p in parts):
                raise CheckpointError(f"a peer sent a replica file named {f.get('rel')!r}; refused")
            if "cuts" in f and not valid_cuts(f["cuts"], f.get("size")):
                raise CheckpointError(f"a peer sent replica file {f['rel']} with malformed checksum pieces; refused")
        self.dest, self.files = dest, files
        self._hashes = [FileDigest(f.get("cuts")) for f in files]
        self._sizes = [0] * len(files)
        self._index, self._file = -1, None
        for f in files:
            self._open(f["rel"]).close()  # empty files exist too

    def _open(self, rel: str):
        """A file of the bundle, for writing: its directory checked private, the file never through a link."""
        path = os.path.join(self.dest, rel)
        private_dir(os.path.dirname(path), "replica_dir", root=self.dest)
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                         "wb")

    def write(self, index: int, data: memoryview) -> None:
        if index != self._index:
            self.close()
            self._file, self._index = self._open(self.files[index]["rel"]), index
        self._file.write(data)
        self._hashes[index].update(data)
        self._sizes[index] += len(data)

    def finish(self) -> dict[str, tuple[int, str]]:
        self.close()
        return {f["rel"]: (self._sizes[i], self._hashes[i].hexdigest()) for i, f in enumerate(self.files)}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def mismatch(expected: list[dict], received: dict[str, tuple[int, str]]) -> str | None:
    """Why ``received`` is not exactly the ``expected`` files (rel, size, xxh3_64), or None."""
    if sorted(received) != sorted(f["rel"] for f in expected):
        return f"it holds {sorted(received)}, not {sorted(f['rel'] for f in expected)}"
    for f in expected:
        size, digest = received[f["rel"]]
        if size != f["size"]:
            return f"{f['rel']} has {size} bytes, expected {f['size']}"
        if digest != f["xxh3_64"]:
            return f"{f['rel']} fails its checksum"
    return None


__all__ = ["Bundle", "PeerLink", "mismatch"]
