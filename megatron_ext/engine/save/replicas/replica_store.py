"""The holder's side of peer replicas: the verified copies this rank keeps for its source rank.

Replicas live in host memory (``<replica_dir>/node-N/of-rank-RRRRR/<checkpoint>/``, by default
under ``/dev/shm``), which outlives the holder's process, so a restarted holder still has them;
only the newest committed replica per source is kept (plus newer, not yet committed ones).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from ...errors import CheckpointError
from ...files import atomic_write_json, private_dir
from ...format.catalog import read_manifest
from ...format.entries import FileEntry
from .peer_link import Bundle, BundleFile, BundleMeta

REPLICA_META = "replica.json"


class ReplicaStore:
    """The replicas this rank holds for its source rank: ``<node_dir>/of-rank-RRRRR/<checkpoint>/``.

    Every directory from ``node_dir`` down is checked private (``files.private_dir``) before each
    use, so a symbolic link or another user's directory put there later is refused, not followed.
    """

    def __init__(self, node_dir: str, source: int):
        self.node_dir = node_dir
        self.base = os.path.join(node_dir, f"of-rank-{source:05d}")
        self.incoming = os.path.join(self.base, ".incoming")

    def _private(self, path: str, create: bool = True) -> str | None:
        return private_dir(path, "replica_dir", root=self.node_dir, create=create)

    def begin(self) -> str:
        self._private(self.base)
        shutil.rmtree(self.incoming, ignore_errors=True)
        return self._private(self.incoming)

    def keep(self, meta: BundleMeta) -> None:
        """Make a fully received and verified replica the held one for its checkpoint."""
        ckpt = meta.checkpoint
        staged = self._private(os.path.join(self.incoming, ckpt))
        atomic_write_json(os.path.join(staged, REPLICA_META), dataclasses.replace(meta, received_at=time.time()).wire())
        final = os.path.join(self._private(self.base), ckpt)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staged, final)

    def held(self, checkpoint: str) -> BundleMeta | None:
        directory = self._private(os.path.join(self.base, checkpoint), create=False)
        if directory is None:
            return None
        try:
            fd = os.open(os.path.join(directory, REPLICA_META), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as f:
                return BundleMeta.from_wire(json.load(f))
        except (OSError, ValueError, CheckpointError):  # unreadable or malformed: not a replica held
            return None

    def offer(self, checkpoint: str, manifest: dict | None, source: int) -> Bundle:
        """The held replica of ``source``'s files of ``manifest`` if present whole, else why not."""
        def refuse(reason: str) -> Bundle:
            return Bundle(BundleMeta(unusable=reason))

        if manifest is None:
            return refuse(f"the holder finds no committed {checkpoint}")
        try:
            held = self.held(checkpoint)
        except CheckpointError as exc:  # not private any more: the source reads from storage instead
            return refuse(str(exc))
        if held is None:
            return refuse(f"no replica of {checkpoint} is held")
        if held.run_id != manifest["run_id"]:
            return refuse(f"the replica of {checkpoint} is of run {held.run_id}, the manifest's is "
                          f"{manifest['run_id']}")
        # A tensor file's checksum is made of its pieces' (format 3): the cuts kept when it was received
        cuts = {f.rel: f.cuts for f in held.files if f.cuts is not None}
        files = [dataclasses.replace(f, cuts=cuts.get(f.rel)) for f in expected_files(manifest, source)]
        for f in files:
            path = os.path.join(self.base, f.rel)
            if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) != f.size:
                return refuse(f"the replica of {f.rel} is missing or has the wrong size")
        return Bundle(BundleMeta(tuple(files), checkpoint, run_id=manifest["run_id"]), self.base)

    def prune(self, root: str) -> None:
        """Keep the newest committed replica and any newer ones; delete the rest."""
        if self._private(self.base, create=False) is None:
            return
        held = []
        for name in os.listdir(self.base):
            meta = self.held(name) if not name.startswith(".") else None
            if meta is not None:
                held.append((name, meta))

        def order(meta: BundleMeta) -> tuple:
            return (meta.version if meta.version is not None else -1, meta.received_at or 0)

        committed = []
        for name, meta in held:
            try:
                manifest = read_manifest(os.path.join(root, name))
            except CheckpointError:
                manifest = None
            if manifest is not None and manifest.get("run_id") == meta.run_id:
                committed.append(meta)
        if not committed:
            return
        newest = max(committed, key=order)
        for name, meta in held:
            if meta is not newest and order(meta) <= order(newest):
                shutil.rmtree(os.path.join(self.base, name), ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def expected_files(manifest: dict, rank: int) -> list[BundleFile]:
    """The files ``rank`` wrote in ``manifest`` (validated): tensor file then sidecar, with sizes and checksums."""
    files = []
    for entry in map(FileEntry.of, manifest["files"].values()):
        if entry.rank == rank:
            files.append(BundleFile(entry.tensor_file, entry.size, entry.checksum))
            files.append(BundleFile(entry.state_file, entry.state_size, entry.state_checksum))
    return files


__all__ = ["REPLICA_META", "ReplicaStore", "expected_files"]
