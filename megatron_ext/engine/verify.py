"""Integrity checks of committed checkpoints: manifest, sizes, headers and checksums.

Used by ``megatron-ext verify`` and available to loaders. Each problem names the file it is
about; the first one is what the command reports.
"""

from __future__ import annotations

import dataclasses
import os

import xxhash

from .commit import read_manifest
from .jobs import CheckpointError
from .layout import read_header

_BLOCK = 16 << 20


@dataclasses.dataclass
class Problem:
    checkpoint: str
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}" if self.path.startswith(self.checkpoint + "/") else f"{self.checkpoint}/{self.path}: {self.what}"


def _file_digest(path: str) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def verify_checkpoint(root: str, checkpoint: str, deep: bool = True) -> list[Problem]:
    """Every problem of one checkpoint (empty if it is committed and intact)."""
    ckpt_dir = os.path.join(root, checkpoint)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as exc:
        return [Problem(checkpoint, "manifest.json", str(exc))]
    if manifest is None:
        return [Problem(checkpoint, "manifest.json", "missing: the checkpoint is not committed")]
    problems: list[Problem] = []
    if manifest.get("checkpoint") not in (None, checkpoint):
        problems.append(Problem(checkpoint, "manifest.json",
                                f"belongs to checkpoint {manifest['checkpoint']!r}, not {checkpoint!r}"))
    ranks = {entry["rank"] for entry in manifest["files"].values()}
    world = manifest.get("world_size", 0)
    if world and not ranks <= set(range(world)):
        problems.append(Problem(checkpoint, "manifest.json", f"lists ranks {sorted(ranks)} outside world size {world}"))
    for name, entry in sorted(manifest["files"].items(), key=lambda kv: (kv[1]["rank"], kv[0])):
        for key, size_key, hash_key in (("tensor_file", "size", "xxh3_64"), ("state_file", "state_size", "state_xxh3_64")):
            rel = entry[key]
            path = os.path.join(root, rel)
            if not os.path.exists(path):
                problems.append(Problem(checkpoint, rel, f"missing (rank {entry['rank']})"))
                continue
            size = os.path.getsize(path)
            if size != entry[size_key]:
                problems.append(Problem(checkpoint, rel, f"has {size} bytes, the manifest says {entry[size_key]}"))
                continue
            if key == "tensor_file":
                try:
                    header, _ = read_header(path)
                except (ValueError, OSError) as exc:
                    problems.append(Problem(checkpoint, rel, f"unreadable safetensors header: {exc}"))
                    continue
                run = header.get("__metadata__", {}).get("run_id")
                if run != manifest["run_id"]:
                    problems.append(Problem(checkpoint, rel, f"written by run {run}, the manifest is from run "
                                                             f"{manifest['run_id']}"))
                    continue
            if deep and _file_digest(path) != entry[hash_key]:
                problems.append(Problem(checkpoint, rel, "checksum mismatch (xxh3-64): the bytes changed"))
    return problems


def verify_root(root: str, iteration_checkpoint: str | None = None, deep: bool = True) -> tuple[list[str], list[Problem]]:
    """(checkpoints checked, problems): one checkpoint if named, else every committed one."""
    if iteration_checkpoint is not None:
        names = [iteration_checkpoint]
    else:  # every directory with a manifest, readable or not
        names = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "manifest.json")))
    problems: list[Problem] = []
    for name in names:
        problems += verify_checkpoint(root, name, deep)
    return names, problems
