"""Reading a committed checkpoint back: parallel aligned reads, checksums verified, no unpickling.

Only the manifest of a committed checkpoint is trusted to say which files exist and where each
tensor lies in them. The bytes are read by ``fast_read`` (several threads, ``O_DIRECT`` where the
file system allows) into one aligned host buffer of which the tensors are views, and each
tensor's xxh3-64 checksum (and, for whole-file reads, the file's) is compared with the manifest's.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch
import xxhash

from . import codec
from .commit import REPORTS, report_name
from .fast_read import MIN_STAGING_CHUNK, Staging, default_staging, read_into, read_tensors, to_device
from .jobs import CheckpointError


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
    """One committed file, read as a whole or tensor by tensor (each verified against the manifest).

    ``threads`` readers per call and ``o_direct`` ("auto", True, False) as in the engine config.
    """

    def __init__(self, base: str, entry: dict, verify: bool = True, level: str = "shared", *,
                 threads: int = 4, o_direct: bool | str = "auto", timeout_s: float = 1800.0,
                 staging: Staging | None = None):
        self.level = level  # the storage level it reads from
        self.entry = entry
        self.verify = verify
        self.threads, self.o_direct, self.timeout_s = threads, o_direct, timeout_s
        self.staging = staging  # resident slots for ``read_into``; a process-wide default if None
        self.tensor_path = os.path.join(base, entry["tensor_file"])
        self.state_path = os.path.join(base, entry["state_file"])
        self._skeleton: Any = None
        self._size_checked = False

    def skeleton(self) -> Any:
        if self._skeleton is None:
            doc = read_state_file(self.state_path, self.entry, self.verify)
            self._skeleton = doc["state"] if isinstance(doc, dict) and doc.get("format") == "megatron_ext.state" else doc
        return self._skeleton

    def tensors(self, names: Iterable[str], whole_file: bool = False, pin: bool = False) -> dict[str, torch.Tensor]:
        """Several tensors in one parallel read (neighbouring ones share requests)."""
        self._check_size()
        return read_tensors(self.tensor_path, self.entry, names, verify=self.verify, whole_file=whole_file,
                            o_direct=self.o_direct, threads=self.threads, pin=pin, timeout_s=self.timeout_s)

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill existing tensors (name -> tensor of the saved dtype and shape) in place, in parallel."""
        self._check_size()
        staging = self.staging
        if staging is None or staging.chunk_bytes < MIN_STAGING_CHUNK:  # tiny slots: too many requests
            staging = default_staging(self.threads)
        read_into(self.tensor_path, self.entry, targets, staging,
                  verify=self.verify, o_direct=self.o_direct, threads=self.threads, timeout_s=self.timeout_s)

    def state_into(self, template: Any, allow_pickle: bool = False, object_modules: tuple[str, ...] = ()) -> Any:
        """The saved state, its tensors read into the matching tensors of ``template`` (same structure)."""
        encoder = codec.Encoder(pickle_fallback=True, object_modules=object_modules)
        encoder.encode(template)
        targets = dict(encoder.tensors)
        self.read_into({n: t for n, t in targets.items() if n in self.entry["tensors"]})
        skeleton = self.skeleton()
        missing = [n for n in codec.tensor_refs(skeleton) if n not in targets]
        tensors = dict(targets)
        if missing:  # tensors the template lacks are read fresh
            tensors.update(self.tensors(missing))
        return self._decode(skeleton, tensors, allow_pickle, object_modules)

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors([name])[name]

    def state(self, map_location: Any = None, allow_pickle: bool = False,
              object_modules: tuple[str, ...] = ()) -> Any:
        """The whole saved state; all tensors read in one pass with the whole-file checksum."""
        tensors = self.tensors(self.entry["tensors"], whole_file=True, pin=_wants_cuda(map_location))
        if map_location is not None:
            tensors = to_device(tensors, map_location)
        return self._decode(self.skeleton(), tensors, allow_pickle, object_modules)

    def part(self, *keys: str, allow_pickle: bool = False, object_modules: tuple[str, ...] = ()) -> Any:
        """One sub-tree of the saved state (top-level str keys), reading only the tensors it refers to."""
        node = self.skeleton()
        for key in keys:
            node = node[key]
        return self._decode(node, self.tensors(codec.tensor_refs(node)), allow_pickle, object_modules)

    def _decode(self, node: Any, tensors: dict[str, torch.Tensor], allow_pickle: bool,
                object_modules: tuple[str, ...]) -> Any:
        def tensor_for(name: str) -> torch.Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise CheckpointError(f"{self.entry['tensor_file']} lacks tensor {name!r}") from None

        return codec.decode(node, tensor_for, allow_pickle=allow_pickle, object_modules=object_modules)

    def _check_size(self) -> None:
        if self._size_checked:
            return
        try:
            size = os.path.getsize(self.tensor_path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {self.tensor_path} is missing") from None
        if size != self.entry["size"]:
            raise CheckpointError(f"{self.tensor_path} has {size} bytes, the manifest says {self.entry['size']}")
        self._size_checked = True


def _wants_cuda(map_location: Any) -> bool:
    """Whether tensors will be copied to a GPU (then the host buffer is pinned for async copies)."""
    if not torch.cuda.is_available() or map_location is None or callable(map_location):
        return False
    target = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
    return torch.device(target).type == "cuda"
