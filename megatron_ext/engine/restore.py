"""Reading a committed checkpoint back: straight into fresh tensors, checksums verified.

Only the manifest of a committed checkpoint is trusted to say which files exist. Each tensor is
read with ``readinto`` directly into the memory of a newly allocated tensor (no intermediate
buffer, no unpickling) and its xxh3-64 checksum compared with the manifest's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import xxhash

from . import codec
from .commit import REPORTS, report_name
from .jobs import CheckpointError
from .layout import read_header, torch_dtype


def _read_exact(f, view: memoryview, path: str) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"{path} is truncated")
        got += n


def read_tensor_file(path: str, entry: dict | None, verify: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, checked against the manifest entry when given."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if entry is not None and size != entry["size"]:
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['size']}")
    header, data_start = read_header(path)
    header.pop("__metadata__", None)
    tensors: dict[str, torch.Tensor] = {}
    whole = xxhash.xxh3_64() if verify and entry is not None else None
    with open(path, "rb", buffering=0) as f:
        if whole is not None:
            whole.update(f.read(data_start))
        f.seek(data_start)
        for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = meta["data_offsets"]
            tensor = torch.empty(meta["shape"], dtype=torch_dtype(meta["dtype"]))
            if end > begin:
                f.seek(data_start + begin)
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                _read_exact(f, view, path)
                if whole is not None:
                    whole.update(view)
                    expected = entry["tensors"].get(name, {}).get("xxh3_64")
                    if expected is not None and xxhash.xxh3_64_hexdigest(view) != expected:
                        raise CheckpointError(f"{path}: tensor {name!r} fails its checksum")
            tensors[name] = tensor
    if whole is not None and whole.hexdigest() != entry["xxh3_64"]:
        raise CheckpointError(f"{path} fails its checksum")
    return tensors


def read_state_file(path: str, entry: dict | None, verify: bool = True) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    if verify and entry is not None and xxhash.xxh3_64_hexdigest(raw) != entry["state_xxh3_64"]:
        raise CheckpointError(f"{path} fails its checksum")
    return json.loads(raw)


def local_copy_complete(local_root: str, checkpoint: str, manifest: dict, rank: int) -> bool:
    """Whether this rank's node-local level holds its files of exactly this committed run."""
    report = os.path.join(local_root, checkpoint, REPORTS, report_name(rank, manifest["run_id"]))
    if not os.path.exists(report):
        return False
    for entry in manifest["files"].values():
        if entry["rank"] != rank:
            continue
        for key, size_key in (("tensor_file", "size"), ("state_file", "state_size")):
            path = os.path.join(local_root, entry[key])
            if not os.path.exists(path) or os.path.getsize(path) != entry[size_key]:
                return False
    return True


class FileReader:
    """One committed file, read as a whole or tensor by tensor (each verified against the manifest)."""

    def __init__(self, base: str, entry: dict, verify: bool = True, level: str = "shared"):
        self.level = level  # the storage level it reads from
        self.entry = entry
        self.verify = verify
        self.tensor_path = os.path.join(base, entry["tensor_file"])
        self.state_path = os.path.join(base, entry["state_file"])
        self._skeleton: Any = None
        self._header: tuple[dict, int] | None = None

    def skeleton(self) -> Any:
        if self._skeleton is None:
            doc = read_state_file(self.state_path, self.entry, self.verify)
            self._skeleton = doc["state"] if isinstance(doc, dict) and doc.get("format") == "megatron_ext.state" else doc
        return self._skeleton

    def tensor(self, name: str) -> torch.Tensor:
        if self._header is None:
            if not os.path.exists(self.tensor_path):
                raise CheckpointError(f"checkpoint file {self.tensor_path} is missing")
            if os.path.getsize(self.tensor_path) != self.entry["size"]:
                raise CheckpointError(f"{self.tensor_path} has {os.path.getsize(self.tensor_path)} bytes, "
                                      f"the manifest says {self.entry['size']}")
            self._header = read_header(self.tensor_path)
        header, data_start = self._header
        meta = header.get(name)
        if meta is None or name == "__metadata__":
            raise CheckpointError(f"{self.entry['tensor_file']} lacks tensor {name!r}")
        begin, end = meta["data_offsets"]
        tensor = torch.empty(meta["shape"], dtype=torch_dtype(meta["dtype"]))
        if end > begin:
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            with open(self.tensor_path, "rb", buffering=0) as f:
                f.seek(data_start + begin)
                _read_exact(f, view, self.tensor_path)
            expected = self.entry["tensors"].get(name, {}).get("xxh3_64")
            if self.verify and expected is not None and xxhash.xxh3_64_hexdigest(view) != expected:
                raise CheckpointError(f"{self.tensor_path}: tensor {name!r} fails its checksum")
        return tensor

    def state(self, map_location: Any = None, allow_pickle: bool = False,
              object_modules: tuple[str, ...] = ()) -> Any:
        """The whole saved state; all tensors read in one pass with the whole-file checksum."""
        tensors = read_tensor_file(self.tensor_path, self.entry, self.verify)
        if map_location is not None:
            tensors = {k: _map(v, map_location) for k, v in tensors.items()}

        def tensor_for(name: str) -> torch.Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise CheckpointError(f"{self.entry['tensor_file']} lacks tensor {name!r}") from None

        return codec.decode(self.skeleton(), tensor_for, allow_pickle=allow_pickle, object_modules=object_modules)

    def part(self, *keys: str, allow_pickle: bool = False, object_modules: tuple[str, ...] = ()) -> Any:
        """One sub-tree of the saved state (top-level str keys), reading only the tensors it refers to."""
        node = self.skeleton()
        for key in keys:
            node = node[key]
        return codec.decode(node, self.tensor, allow_pickle=allow_pickle, object_modules=object_modules)


def _map(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    if callable(map_location):
        return map_location(tensor, "cpu")
    if isinstance(map_location, dict):
        return tensor.to(map_location.get("cpu", "cpu"))
    return tensor.to(map_location)
