"""Typed entries of the format: a file of a manifest, a tensor of a file, and the two together.

Built only from validated JSON (validation.py has checked every field they carry), so a reader
never indexes raw JSON or looks a dtype up by its name again, and a misspelt key fails where it
is typed rather than on another thread. The on-disk format is untouched: these are views of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from .tensor_file import TORCH_DTYPES, st_dtype


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

    @property
    def saved_as(self) -> str:
        """Its dtype and shape as the file's header writes them, e.g. ``BF16[4, 8]`` (for messages)."""
        return f"{st_dtype(self.dtype)}{list(self.shape)}"

    @classmethod
    def of(cls, name: str, meta: dict) -> "TensorEntry":
        """From a validated tensor index entry (``{dtype, shape, offsets, xxh3_64}``)."""
        begin, end = meta["offsets"]
        return cls(name, TORCH_DTYPES[meta["dtype"]], tuple(meta["shape"]), begin, end, meta["xxh3_64"])


@dataclasses.dataclass(frozen=True)
class ListedFile:
    """A file as the manifest and its rank's report list it, its entry and its tensors by name: all a
    reader needs to place and check every byte. ``tensors`` keeps the index's (the writer's) order."""

    file: FileEntry
    tensors: Mapping[str, TensorEntry]

    def select(self, names: Iterable[str]) -> dict[str, TensorEntry]:
        """The entries of ``names``; ``CheckpointError`` naming the file for one it does not hold."""
        chosen: dict[str, TensorEntry] = {}
        tensors = self.tensors
        for name in names:
            tensor = tensors.get(name)
            if tensor is None:
                raise CheckpointError(f"{self.file.tensor_file} lacks tensor {name!r}")
            chosen[name] = tensor
        return chosen


__all__ = ["FileEntry", "ListedFile", "TensorEntry"]
