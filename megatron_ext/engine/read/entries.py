"""A committed manifest, typed: what readers and the save side look at instead of its dict.

``CommittedManifest`` is the one form of a committed manifest on both sides: what the committer
hands to ``on_committed`` callbacks and retention, and what a reader loads. Its header is typed;
its file list is read from disk only by an explicit ``load`` (rank 0 writes the manifest from
encoded shares without decoding them, and sending every rank the whole list would cost the
commit store O(ranks^2) bytes per checkpoint).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping

from ..errors import CheckpointError
from ..format.catalog import read_manifest
from ..format.entries import FileEntry
from ..format.names import MANIFEST


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


__all__ = ["CommittedManifest"]
