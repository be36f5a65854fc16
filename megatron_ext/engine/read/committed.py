"""Opening a committed checkpoint: its validated manifest and a reader per file, from the best
level that has it. One way for every reader (the engine's ``load``, the Megatron-LM load, export,
convert, verify, inspect), with no engine and nothing of the save pipeline.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Protocol

from ..collectives import all_reduce_int
from ..config import EngineConfig
from ..errors import CheckpointError
from ..object_store import is_object_url, resolve_root
from ..format import codec
from ..format.catalog import read_manifest
from ..format.entries import FileEntry, ListedFile, TensorEntry
from ..format.manifest import TensorIndex
from ..format.names import LEVEL_LOCAL, LEVEL_PEER, LEVEL_SHARED
from ..host_cache import HostCache
from . import file_reader, object_fetch
from .entries import CommittedManifest


class PeerSource(Protocol):
    """Where a rank whose node-local copy is gone fetches its files (the save side's peer replicas).

    ``recover`` is a collective: every rank calls it once per open, even one that cannot load."""

    def recover(self, checkpoint: str, manifest: dict | None, local_complete: bool) -> dict[str, str]: ...


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How to read: checksums, parallel reads, ``O_DIRECT`` staging, the node-local level, the
    classes the sidecar may name beyond the built-in allow-list, and peers to recover from."""

    verify: bool = True
    threads: int = EngineConfig.restore_threads
    o_direct: bool | str = EngineConfig.o_direct
    timeout_s: float = EngineConfig.persist_timeout_s
    local_dir: str | None = None
    rank: int = 0
    staging: HostCache | None = None
    classes: Mapping[codec.ClassKey, type] | None = None
    peers: PeerSource | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **overrides) -> "ReadOptions":
        """The options a run with ``config`` reads with (its threads, ``O_DIRECT``, timeout, node-local level)."""
        base = dict(threads=config.restore_threads, o_direct=config.o_direct, timeout_s=config.persist_timeout_s,
                    local_dir=config.local_dir)
        return cls(**{**base, **overrides})


def open_committed(root: str, name: str, options: ReadOptions | None = None, *,
                   manifest: dict | None = None) -> "CommittedCheckpoint":
    """Checkpoint ``name`` under ``root``, validated; ``CheckpointError`` naming the manifest if it is
    not committed or malformed.

    ``manifest``: this checkpoint's manifest as ``read_manifest`` returned it (validated), when
    the caller has it already (``locate.resolve``), so it is not read twice.

    With ``options.peers`` this is a collective: every rank takes part, even one that cannot load,
    and ranks whose node-local copy is gone fetch their files from the peer holding them.
    """
    options = options or ReadOptions()
    path = os.path.join(root, name)
    problem: CheckpointError | None = None
    if manifest is None:
        try:
            manifest = read_manifest(path)
            if manifest is None:
                problem = CheckpointError(f"{path} is not a committed checkpoint (no manifest)")
        except CheckpointError as exc:
            manifest, problem = None, exc
    elif manifest.get("checkpoint") != name:
        raise ValueError(f"the manifest given is checkpoint {manifest.get('checkpoint')!r}'s, not {name!r}'s")
    recovered: dict[str, str] = {}
    if options.peers is not None:
        have_local = bool(options.local_dir) and manifest is not None and file_reader.local_copy_complete(
            options.local_dir, name, manifest, options.rank)
        recovered = options.peers.recover(name, manifest, have_local)
    if problem is not None:
        raise problem
    return CommittedCheckpoint(root, name, manifest, options, recovered)


class CommittedCheckpoint:
    """Read side of one committed checkpoint: each file from the node-local level when complete
    there, else from a peer's replica when one was recovered, else from the shared level.

    A multi-rank job should agree on node-local or shared for all ranks (``local_copy_complete``
    on every rank, reduced with MIN, then ``use_level``): a mix would read some ranks' files from a
    node-local copy that another rank may never have finished. Peer copies were verified against
    the manifest when recovered and are used under either choice.
    """

    def __init__(self, root: str, checkpoint: str, manifest: dict, options: ReadOptions | None = None,
                 recovered: dict[str, str] | None = None):
        """``manifest`` must come from ``read_manifest`` (validated); ``open_committed`` builds this."""
        options = options or ReadOptions()
        self.root, self.checkpoint, self.manifest, self.options = resolve_root(root), checkpoint, manifest, options
        #: The same manifest in the form the save side hands to ``on_committed`` (entries.py): typed header and files.
        self.committed = CommittedManifest.loaded(manifest, os.path.join(self.root, checkpoint))
        self.local_dir, self.verify, self.classes = options.local_dir, options.verify, options.classes
        self.recovered = recovered or {}  # file name -> directory of its verified peer copy
        self.index = TensorIndex(os.path.join(self.root, checkpoint), manifest)  # each rank report read once
        self._readers: dict[str, file_reader.FileReader] = {}
        self._files: dict[str, FileEntry] | None = None  # built on first use: the engine's load needs none
        self._tensors: dict[str, dict[str, TensorEntry]] = {}
        self.levels_used: set[str] = set()
        self.default_level = "auto"

    def local_copy_complete(self, rank: int) -> bool:
        """Whether ``rank``'s files of this checkpoint are all on this node's local level."""
        return bool(self.local_dir) and file_reader.local_copy_complete(self.local_dir, self.checkpoint,
                                                                    self.manifest, rank)

    def agree_level(self, rank: int, world_size: int) -> str:
        """Collective over all ranks: read node-local only if every rank's own files are complete there.

        One all_reduce (MIN) of "my files are on my node-local level"; returns the level chosen
        ("local" or "shared") and makes the readers use it.
        """
        local = int(self.local_copy_complete(rank))
        if world_size > 1:
            import torch.distributed as dist

            local = all_reduce_int(local, dist.ReduceOp.MIN)
        self.use_level("auto" if local else LEVEL_SHARED)
        return LEVEL_LOCAL if local else LEVEL_SHARED

    def use_level(self, level: str) -> None:
        """Level for readers created from now on: "shared" always, "auto" node-local where complete."""
        if level not in ("auto", LEVEL_SHARED):
            raise ValueError(f"level must be \"auto\" or \"shared\", got {level!r}")
        self.default_level = level

    # ------------------------------------------------------------------ typed entries
    @property
    def run_id(self) -> str:
        return self.committed.run_id

    @property
    def world_size(self) -> int:
        return self.committed.world_size

    @property
    def version(self) -> int | None:
        """The version the saver gave the checkpoint (e.g. its iteration), if any."""
        return self.committed.version

    def _file_entries(self) -> dict[str, FileEntry]:
        if self._files is None:
            self._files = self.committed.files()
        return self._files

    def files(self) -> list[FileEntry]:
        """Every file, by name."""
        return list(self._file_entries().values())

    def file(self, name: str) -> FileEntry:
        """File ``name``; ``CheckpointError`` if the checkpoint has none of that name."""
        if self._files is not None:
            found = self._files.get(name)
        else:  # one entry typed, not the whole list: each rank's load reads one file of thousands
            entry = self.manifest["files"].get(name)
            found = None if entry is None else FileEntry.of(entry)
        if found is None:
            raise self._no_file(name)
        return found

    def _no_file(self, name: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.checkpoint} has no file {name!r}; "
                               f"it has {sorted(self.manifest['files'])[:8]}")

    def files_of_rank(self, rank: int) -> list[FileEntry]:
        """The files global rank ``rank`` saved, by name."""
        return [f for f in self._file_entries().values() if f.rank == rank]

    def tensors(self, name: str) -> dict[str, TensorEntry]:
        """File ``name``'s tensors by name (format 2: its rank's report read and checked on first use)."""
        if name not in self._tensors:
            if name not in self.manifest["files"]:
                raise self._no_file(name)
            self._tensors[name] = {t: TensorEntry.of(t, meta) for t, meta in self.index.tensors(name).items()}
        return self._tensors[name]

    def listed(self, name: str) -> ListedFile:
        """File ``name``'s entry with its tensors (format 2: from its rank's report)."""
        return ListedFile(self.file(name), self.tensors(name))

    def reader(self, name: str, level: str = "auto") -> file_reader.FileReader:
        """The reader of file ``name``: node-local when complete there (``level="local"`` requires it)."""
        if name not in self._readers:
            file = self.file(name)
            asked = level
            if level == "auto":
                level = self.default_level
            base, chosen = self.root, LEVEL_SHARED
            if level in ("auto", LEVEL_LOCAL) and self.local_copy_complete(file.rank):
                base, chosen = self.local_dir, LEVEL_LOCAL
            elif level == LEVEL_LOCAL:
                raise CheckpointError(f"checkpoint {self.checkpoint} is not complete on the node-local level")
            elif name in self.recovered and asked in ("auto", LEVEL_PEER):
                base, chosen = self.recovered[name], LEVEL_PEER
            self.levels_used.add(chosen)
            options = self.options
            listed = self.listed(name)
            fetched = None
            if is_object_url(base):  # the object-store level: the file's objects fetched first
                base = fetched = object_fetch.fetch(self.root, self.checkpoint, listed.file, options.local_dir)
            reader = file_reader.FileReader(
                base, listed, options.verify, level=chosen, run_id=self.manifest["run_id"], classes=options.classes,
                format_version=self.manifest["format_version"],
                threads=options.threads, o_direct=options.o_direct, timeout_s=options.timeout_s, staging=options.staging)
            if fetched is not None:
                object_fetch.release_with(reader, fetched)
            self._readers[name] = reader
        return self._readers[name]


__all__ = ["CommittedCheckpoint", "FileEntry", "PeerSource", "ReadOptions", "TensorEntry", "open_committed"]
