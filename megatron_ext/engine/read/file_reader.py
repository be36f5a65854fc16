"""Reading a committed checkpoint back: parallel aligned reads, checksums verified, no unpickling.

Only the manifest of a committed checkpoint is trusted to say which files exist and where each
tensor lies in them. The bytes are read by ``fast_read`` (several threads, ``O_DIRECT`` where the
file system allows) into one aligned host buffer of which the tensors are views, or by
``staged_read`` into tensors that exist already, and each tensor's xxh3-64 checksum (and, for
whole-file reads, the file's) is compared with the manifest's.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Iterable, Mapping

import torch

from ..errors import CheckpointError
from ..files import open_regular
from ..format import codec
from ..format.digest import PIECEWISE_FROM_VERSION
from ..format.entries import FileEntry, ListedFile
from ..format.names import REPORTS, report_name
from ..format.sidecar import read_sidecar
from ..format.validation import read_listed_header
from ..format.version import FORMAT_VERSION
from .fast_read import read_tensors, to_device
from .staged_read import MIN_STAGING_CHUNK, Staging, default_staging, read_into


def local_copy_complete(local_root: str, checkpoint: str, manifest: dict, rank: int) -> bool:
    """Whether this rank's node-local level holds its files of exactly this committed run."""
    report = os.path.join(local_root, checkpoint, REPORTS, report_name(rank, manifest["run_id"]))
    if not os.path.exists(report):
        return False
    for file in (FileEntry.of(e) for e in manifest["files"].values() if e["rank"] == rank):
        for relative, size in ((file.tensor_file, file.size), (file.state_file, file.state_size)):
            try:
                st = os.lstat(os.path.join(local_root, relative))
            except OSError:
                return False
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return False
    return True


class FileReader:
    """One committed file, read as a whole or tensor by tensor (each verified against the manifest).

    ``threads`` readers per call and ``o_direct`` ("auto", True, False) as in the engine config.
    """

    def __init__(self, base: str, listed: ListedFile, verify: bool = True, level: str = "shared", *,
                 threads: int = 4, o_direct: bool | str = "auto", timeout_s: float = 1800.0,
                 staging: Staging | None = None, run_id: str | None = None,
                 classes: Mapping[codec.ClassKey, type] | None = None, format_version: int = FORMAT_VERSION):
        self.level = level  # the storage level it reads from
        self.listed = listed  # from a validated manifest (manifest.read_manifest)
        self.run_id = run_id  # the manifest's: the file's header must name it
        self.classes = classes  # allowed classes beyond the process-wide ones
        self.verify = verify
        self.piecewise = format_version >= PIECEWISE_FROM_VERSION  # how the file's own checksum is made
        self.threads, self.o_direct, self.timeout_s = threads, o_direct, timeout_s
        self.staging = staging  # resident slots for ``read_into``; a process-wide default if None
        self.tensor_path = os.path.join(base, listed.file.tensor_file)
        self.state_path = os.path.join(base, listed.file.state_file)
        self._skeleton: Any = None
        self._file_checked = False

    def skeleton(self) -> Any:
        if self._skeleton is None:
            self._skeleton = read_sidecar(self.state_path, self.listed, self.verify)
        return self._skeleton

    def tensors(self, names: Iterable[str], whole_file: bool = False, pin: bool = False) -> dict[str, torch.Tensor]:
        """Several tensors in one parallel read (neighbouring ones share requests)."""
        self._check_file()
        return read_tensors(self.tensor_path, self.listed, names, verify=self.verify, whole_file=whole_file,
                            piecewise=self.piecewise, o_direct=self.o_direct, threads=self.threads, pin=pin,
                            timeout_s=self.timeout_s)

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill existing tensors (name -> tensor of the saved dtype and shape) in place, in parallel."""
        self._check_file()
        staging = self.staging
        # Tiny slots cost too many requests; fewer slots than readers + 1 leave readers idle.
        if staging is None or staging.chunk_bytes < MIN_STAGING_CHUNK or staging.num_slots <= self.threads:
            staging = default_staging(self.threads)
        read_into(self.tensor_path, self.listed, targets, staging,
                  verify=self.verify, o_direct=self.o_direct, threads=self.threads, timeout_s=self.timeout_s)

    def state_into(self, template: Any, allow_pickle: bool = False) -> Any:
        """The saved state, its tensors read into the matching tensors of ``template`` (same structure).

        Every tensor the sidecar refers to must be in the manifest; those the template lacks are
        read fresh, and template tensors the sidecar does not refer to are left alone.
        """
        encoder = codec.Encoder(pickle_fallback=True, classes=self.classes)
        encoder.encode(template)
        targets = dict(encoder.tensors)
        refs = self._refs(self.skeleton())
        self.read_into({n: targets[n] for n in refs if n in targets})
        tensors = {n: targets[n] for n in refs if n in targets}
        fresh = [n for n in refs if n not in targets]
        if fresh:
            tensors.update(self.tensors(fresh))
        return self._decode(self.skeleton(), tensors, allow_pickle)

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors([name])[name]

    def state(self, map_location: Any = None, allow_pickle: bool = False) -> Any:
        """The whole saved state; all tensors read in one pass with the whole-file checksum."""
        self._refs(self.skeleton())
        tensors = self.tensors(self.listed.tensors, whole_file=True, pin=_wants_cuda(map_location))
        if map_location is not None:
            tensors = to_device(tensors, map_location)
        return self._decode(self.skeleton(), tensors, allow_pickle)

    def has_part(self, *keys: str) -> bool:
        """Whether the saved state has the sub-tree ``keys`` (optional parts, such as a framework's extras)."""
        node = self.skeleton()
        for key in keys:
            if type(node) is not dict or key not in node:
                return False
            node = node[key]
        return True

    def part(self, *keys: str, allow_pickle: bool = False) -> Any:
        """One sub-tree of the saved state (top-level str keys), reading only the tensors it refers to."""
        node = self.skeleton()
        for key in keys:
            if type(node) is not dict or key not in node:
                raise CheckpointError(f"{self.state_path} has no {'/'.join(keys)!r} in its state")
            node = node[key]
        return self._decode(node, self.tensors(self._refs(node)), allow_pickle)

    def _refs(self, node: Any) -> list[str]:
        """The tensors ``node`` refers to, each of which the manifest must list."""
        refs = codec.tensor_refs(node)
        for name in refs:
            if type(name) is not str or name not in self.listed.tensors:
                raise CheckpointError(f"{self.state_path} refers to tensor {name!r}, which the manifest does not "
                                      f"list for {self.listed.file.tensor_file}")
        return refs

    def _decode(self, node: Any, tensors: dict[str, torch.Tensor], allow_pickle: bool) -> Any:
        def tensor_for(name: str) -> torch.Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise CheckpointError(f"{self.listed.file.tensor_file} lacks tensor {name!r}") from None

        return codec.decode(node, tensor_for, allow_pickle=allow_pickle, classes=self.classes, where=self.state_path)

    def _check_file(self) -> None:
        """Once per reader: a regular file of the manifest's size whose header matches the manifest."""
        if self._file_checked:
            return
        fd = open_regular(self.tensor_path)
        try:
            read_listed_header(fd, self.listed, self.run_id, self.tensor_path)
        finally:
            os.close(fd)
        self._file_checked = True


def _wants_cuda(map_location: Any) -> bool:
    """Whether tensors will be copied to a GPU (then the host buffer is pinned for async copies)."""
    if not torch.cuda.is_available() or map_location is None or callable(map_location):
        return False
    target = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
    return torch.device(target).type == "cuda"
