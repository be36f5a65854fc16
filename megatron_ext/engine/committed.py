"""The read side: one committed checkpoint and a reader per file, from the best level that has it.

Apart from ``engine.py`` so that loading reads without the save machinery; adapters that read
selectively (shard assembly, export) build a ``CommittedCheckpoint`` directly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping

from . import codec, restore
from .collectives import all_reduce_int
from .config import EngineConfig
from .host_cache import HostCache
from .jobs import CheckpointError, LEVEL_LOCAL, LEVEL_PEER, LEVEL_SHARED
from .manifest import TensorIndex, read_manifest

if TYPE_CHECKING:
    from .replica import PeerReplicas


class CommittedCheckpoint:
    """Read side of one committed checkpoint: each file from the node-local level when complete
    there, else from a peer's replica when one was recovered, else from the shared level.

    A multi-rank job should agree on node-local or shared for all ranks (``local_copy_complete``
    on every rank, reduced with MIN, then ``use_level``): a mix would read some ranks' files from a
    node-local copy that another rank may never have finished. Peer copies were verified against
    the manifest when recovered and are used under either choice.
    """

    def __init__(self, root: str, local_dir: str | None, checkpoint: str, manifest: dict, verify: bool,
                 config: EngineConfig | None = None, staging: HostCache | None = None,
                 recovered: dict[str, str] | None = None, classes: Mapping[codec.ClassKey, type] | None = None):
        """``manifest`` must come from ``read_manifest`` (validated); ``classes`` extend the allow-list."""
        self.root, self.local_dir, self.checkpoint, self.manifest, self.verify = root, local_dir, checkpoint, manifest, verify
        self.classes = classes
        config = config or EngineConfig()
        self._read_options = {"threads": config.restore_threads, "o_direct": config.o_direct,
                              "timeout_s": config.persist_timeout_s, "staging": staging}
        self.recovered = recovered or {}  # file name -> directory of its verified peer copy
        self.index = TensorIndex(os.path.join(root, checkpoint), manifest)  # each rank report read once
        self._readers: dict[str, restore.FileReader] = {}
        self.levels_used: set[str] = set()
        self.default_level = "auto"

    @classmethod
    def open(cls, root: str, checkpoint: str, config: EngineConfig, rank: int, *, verify: bool = True,
             staging: HostCache | None = None, replicas: "PeerReplicas | None" = None,
             classes: Mapping[codec.ClassKey, type] | None = None) -> "CommittedCheckpoint":
        """Read and validate ``checkpoint``'s manifest under ``root``; error if it is not committed.

        With ``replicas`` this is a collective: every rank takes part, even one that cannot load,
        and ranks whose node-local copy is gone fetch their files from the peer holding them.
        """
        path = os.path.join(root, checkpoint)
        problem: CheckpointError | None = None
        try:
            manifest = read_manifest(path)
            if manifest is None:
                problem = CheckpointError(f"{path} is not a committed checkpoint (no manifest)")
        except CheckpointError as exc:
            manifest, problem = None, exc
        recovered: dict[str, str] = {}
        if replicas is not None:
            local = config.local_dir
            have_local = bool(local) and manifest is not None and restore.local_copy_complete(
                local, checkpoint, manifest, rank)
            recovered = replicas.recover(checkpoint, manifest, have_local)
        if problem is not None:
            raise problem
        return cls(root, config.local_dir, checkpoint, manifest, verify, config, staging, recovered, classes)

    def local_copy_complete(self, rank: int) -> bool:
        """Whether ``rank``'s files of this checkpoint are all on this node's local level."""
        return bool(self.local_dir) and restore.local_copy_complete(self.local_dir, self.checkpoint,
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

    def entry(self, name: str) -> dict:
        """File ``name``'s manifest entry with its tensors (from its rank's report in format 2)."""
        return self.index.entry(name)

    def reader(self, name: str, level: str = "auto") -> restore.FileReader:
        """The reader of file ``name``: node-local when complete there (``level="local"`` requires it)."""
        if name not in self._readers:
            entry = self.manifest["files"].get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {self.checkpoint} has no file {name!r}; "
                                      f"it has {sorted(self.manifest['files'])[:8]}")
            asked = level
            if level == "auto":
                level = self.default_level
            base, chosen = self.root, LEVEL_SHARED
            if level in ("auto", LEVEL_LOCAL) and self.local_copy_complete(entry["rank"]):
                base, chosen = self.local_dir, LEVEL_LOCAL
            elif level == LEVEL_LOCAL:
                raise CheckpointError(f"checkpoint {self.checkpoint} is not complete on the node-local level")
            elif name in self.recovered and asked in ("auto", LEVEL_PEER):
                base, chosen = self.recovered[name], LEVEL_PEER
            self.levels_used.add(chosen)
            entry = self.index.entry(name)
            self._readers[name] = restore.FileReader(base, entry, self.verify, level=chosen, run_id=self.manifest["run_id"],
                                                     classes=self.classes, **self._read_options)
        return self._readers[name]


__all__ = ["CommittedCheckpoint"]
