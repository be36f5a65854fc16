"""Typed entries of a committed checkpoint: what readers look at instead of the manifest's dicts.

Built only from a validated manifest and ``TensorIndex`` (format/validation.py has checked every
field they carry), so a reader never indexes raw JSON or looks a dtype up by its name again. The
on-disk format is untouched: these are views of it.

``CommittedManifest`` is the one form of a committed manifest on both sides: what the committer
hands to ``on_committed`` callbacks and retention, and what a reader loads. Its header is typed;
its file list is read from disk only by an explicit ``load`` (rank 0 writes the manifest from
encoded shares without decoding them, and sending every rank the whole list would cost the
commit store O(ranks^2) bytes per checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.catalog import read_manifest
from ..format.names import MANIFEST
from ..format.tensor_file import TORCH_DTYPES


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of the checkpoint: the rank that saved it, its tensor file and sidecar (paths
    relative to the checkpoints' root), their sizes and checksums, and the adapter's ``extra``."""

    name: str
    rank: int
    tensor_file: str
    state_file: str
    size: int  # bytes of the tensor file
    state_size: int  # bytes of the sidecar
    checksum: str  # xxh3-64 of the tensor file
    state_checksum: str  # xxh3-64 of the sidecar
    #: What the adapter that saved the file recorded (not validated with the manifest: the adapter's to check).
    extra: Any = dataclasses.field(default=None, compare=False)

    @property
    def total_bytes(self) -> int:
        """Bytes on disk: the tensor file and its sidecar."""
        return self.size + self.state_size

    @classmethod
    def of(cls, entry: dict) -> "FileEntry":
        """From a validated manifest's file entry."""
        return cls(entry["name"], entry["rank"], entry["tensor_file"], entry["state_file"], entry["size"],
                   entry["state_size"], entry["xxh3_64"], entry["state_xxh3_64"], entry.get("extra"))


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its dtype and shape as saved, its bytes ``[begin, end)`` in the tensor
    file, and their xxh3-64."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    checksum: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, name: str, meta: dict) -> "TensorEntry":
        """From a validated tensor index entry (``{dtype, shape, offsets, xxh3_64}``)."""
        begin, end = meta["offsets"]
        return cls(name, TORCH_DTYPES[meta["dtype"]], tuple(meta["shape"]), begin, end, meta["xxh3_64"])


class CommittedManifest(Mapping):
    """A committed manifest: its header at once, its ``files`` and ``reports`` once ``load`` read them.

    A read-only mapping of the manifest's JSON, as callbacks always got it: ``manifest["files"]``
    loads (one validated read of the manifest, checked to be the run rank 0 committed); the
    header's keys never touch the disk. ``files()`` gives the typed entries.
    """

    ON_DISK = ("files", "reports")

    def __init__(self, header: dict, checkpoint_dir: str):
        self._header = dict(header)
        self.checkpoint_dir = checkpoint_dir
        self._full: dict | None = None
        self._lock = threading.Lock()  # callbacks may hand it to threads of their own

    @classmethod
    def loaded(cls, manifest: dict, checkpoint_dir: str) -> "CommittedManifest":
        """From a manifest already read and validated (``read_manifest``)."""
        made = cls({k: v for k, v in manifest.items() if k not in cls.ON_DISK}, checkpoint_dir)
        made._full = manifest
        return made

    # ------------------------------------------------------------------ the header, typed
    @property
    def checkpoint(self) -> str:
        return self._header["checkpoint"]

    @property
    def run_id(self) -> str:
        return self._header["run_id"]

    @property
    def version(self) -> int | None:
        return self._header.get("version")

    @property
    def world_size(self) -> int:
        return self._header["world_size"]

    # ------------------------------------------------------------------ the file list, loaded explicitly
    def load(self) -> dict:
        """The whole manifest, read from disk the first time (``CheckpointError``: not the one committed)."""
        with self._lock:
            if self._full is None:
                manifest = read_manifest(self.checkpoint_dir)
                if manifest is None or manifest["run_id"] != self.run_id:
                    raise CheckpointError(f"{os.path.join(self.checkpoint_dir, MANIFEST)}: not the manifest rank 0 "
                                          f"committed (run {self.run_id})")
                self._full = manifest
            return self._full

    def files(self) -> dict[str, FileEntry]:
        """Every file of the checkpoint, typed, by name (loads)."""
        return {name: FileEntry.of(entry) for name, entry in sorted(self.load()["files"].items())}

    # ------------------------------------------------------------------ the mapping
    def __getitem__(self, key: str):
        if key in self._header:
            return self._header[key]
        if key in self.ON_DISK:
            return self.load()[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        """The header's keys, and once loaded the whole manifest's (as the JSON holds them so far)."""
        full = self._full
        return iter(full if full is not None else self._header)

    def __len__(self) -> int:
        full = self._full
        return len(full if full is not None else self._header)

    def __contains__(self, key: object) -> bool:
        full = self._full
        return key in (full if full is not None else self._header)

    def get(self, key: str, default=None):
        """Like a dict's, except that ``files`` and ``reports`` load."""
        try:
            return self[key]
        except KeyError:
            return default

    def header(self) -> dict:
        """The header's JSON (a copy)."""
        return dict(self._header)

    def __repr__(self) -> str:
        return f"CommittedManifest({self._header!r}, {self.checkpoint_dir!r})"


__all__ = ["CommittedManifest", "FileEntry", "TensorEntry"]
