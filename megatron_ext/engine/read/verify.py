"""Integrity checks of committed checkpoints, as strict as a loader.

Used by ``megatron-ext verify`` and available to loaders. Whatever passes here loads with the
engine and with the ``safetensors`` library; whatever either would reject fails here, naming the
file and the reason: the manifest is validated (manifest.py), every tensor file is a regular file
of the manifest's size whose safetensors header is checked as strictly as the library checks it
and matches the manifest exactly, every sidecar is well-formed and refers only to listed tensors,
and (unless ``deep=False``) every file's and every tensor's xxh3-64 equals the manifest's (from
format 3 a file's is made of its header's and its tensors', format/digest.py: one pass). From
format 2 each rank report (the tensor index) is checked against the manifest's size and xxh3-64
and validated first; a rank whose report fails has that one problem reported, not one per file.
Which classes a sidecar may rebuild is the loader's choice (its allow-list), not checked here.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Callable

import xxhash

from ..errors import CheckpointError
from ..files import open_regular
from ..format import codec
from ..format.catalog import checkpoint_dirs, manifest_exists, read_manifest
from ..format.digest import PIECEWISE_FROM_VERSION, tensor_file_digest
from ..format.names import MANIFEST, valid_name
from ..format.sidecar import read_sidecar
from ..format.validation import read_listed_header
from ..object_store import is_object_url, resolve_root
from . import object_fetch
from .committed import CommittedCheckpoint, ReadOptions, open_committed
from ..format.entries import TensorEntry

_BLOCK = 16 << 20


@dataclasses.dataclass
class Problem:
    checkpoint: str
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}" if self.path.startswith(self.checkpoint + "/") else f"{self.checkpoint}/{self.path}: {self.what}"


def verify_checkpoint(root: str, checkpoint: str, deep: bool = True,
                      progress: "Callable[[int, int], None] | None" = None) -> list[Problem]:
    """Every problem of one checkpoint (empty if it is committed and intact).

    ``progress(nbytes, files)`` is called as bytes are read and files finished (for a progress display).
    """
    ckpt_dir = os.path.join(root, checkpoint)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as exc:
        return [Problem(checkpoint, MANIFEST, str(exc).removeprefix(os.path.join(ckpt_dir, MANIFEST) + ": "))]
    if manifest is None:
        return [Problem(checkpoint, MANIFEST, "missing: the checkpoint is not committed")]
    committed = open_committed(root, checkpoint, ReadOptions(verify=deep), manifest=manifest)
    problems: list[Problem] = []
    bad_ranks = set()
    for rank in range(committed.world_size) if manifest["format_version"] >= 2 else ():
        try:
            committed.index.rank_tensors(rank)
        except CheckpointError as exc:
            bad_ranks.add(rank)
            rel = manifest["reports"][str(rank)]["file"]
            what = str(exc).removeprefix(committed.index.report_path(rank) + ": ")
            problems.append(Problem(checkpoint, rel, f"{what} (rank {rank})"))
    for file in sorted(committed.files(), key=lambda f: (f.rank, f.name)):
        if file.rank in bad_ranks:
            continue  # its tensor index is unusable: reported once above
        for rel, check in ((file.tensor_file, _check_tensor_file), (file.state_file, _check_state_file)):
            try:
                check(root, committed, file.name, deep, progress)
            except CheckpointError as exc:
                what = str(exc)
                for prefix in (os.path.join(root, rel) + ": ", os.path.join(root, rel) + " "):
                    what = what.removeprefix(prefix)
                problems.append(Problem(checkpoint, rel, f"{what} (rank {file.rank})"))
        if progress is not None:
            progress(0, 1)
    return problems


def checkpoint_bytes(root: str, checkpoint: str) -> tuple[int, int]:
    """(bytes, files) a deep verify of ``checkpoint`` reads, from its manifest; (0, 0) if it has none
    or it is unreadable (``verify_checkpoint`` says why)."""
    try:
        files = open_committed(root, checkpoint, ReadOptions(verify=False)).files()
    except CheckpointError:
        return 0, 0
    return sum(f.total_bytes for f in files), len(files)


def _check_tensor_file(root: str, committed: CommittedCheckpoint, name: str, deep: bool, progress=None) -> None:
    """The tensor file against the manifest: regular, its size, its header exactly, and (deep) every checksum."""
    file = committed.file(name)
    path = os.path.join(root, file.tensor_file)
    if is_object_url(root):  # the object fetched, then checked as a file; errors name the object
        base = object_fetch.fetch(root, committed.checkpoint, file, None, sidecar=False)  # read on its own below
        try:
            fd = open_regular(os.path.join(base, file.tensor_file))
        finally:
            shutil.rmtree(base, ignore_errors=True)  # the open descriptor keeps the bytes readable
    else:
        fd = open_regular(path)
    try:
        header = read_listed_header(fd, committed.listed(name), committed.run_id, path)
        if deep:
            piecewise = committed.manifest["format_version"] >= PIECEWISE_FROM_VERSION
            _check_digests(fd, path, committed.tensors(name), file.checksum, header.data_start, piecewise, progress)
        elif progress is not None:
            progress(file.size, 0)
    finally:
        os.close(fd)


def _check_digests(fd: int, path: str, tensors: dict[str, TensorEntry], checksum: str, data_start: int,
                   piecewise: bool, progress=None) -> None:
    """One sequential pass: every tensor's xxh3-64 (tensors cover the data), and the file's: of its
    header's and tensors' digests (``piecewise``, format 3) or of its bytes (formats 1 and 2)."""
    head = _read(fd, path, 0, data_start)
    whole = None if piecewise else xxhash.xxh3_64(head)
    for tensor in sorted(tensors.values(), key=lambda t: (t.begin, t.end, t.name)):
        digest = xxhash.xxh3_64()
        for lo in range(tensor.begin, tensor.end, _BLOCK):
            block = _read(fd, path, lo, min(_BLOCK, tensor.end - lo))
            digest.update(block)
            if whole is not None:
                whole.update(block)
            if progress is not None:
                progress(len(block), 0)
        if digest.hexdigest() != tensor.checksum:
            raise CheckpointError(f"{path}: checksum mismatch (xxh3-64) in tensor {tensor.name!r}: the bytes changed")
    if piecewise:
        found = tensor_file_digest(xxhash.xxh3_64_intdigest(head), ((t.begin, t.end, t.checksum) for t in tensors.values()))
    else:
        found = whole.hexdigest()
    if found != checksum:
        raise CheckpointError(f"{path}: checksum mismatch (xxh3-64): the bytes changed")


def _read(fd: int, path: str, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise CheckpointError(f"{path}: truncated while being read")
    return data


def _check_state_file(root: str, committed: CommittedCheckpoint, name: str, deep: bool, progress=None) -> None:
    """The sidecar: well-formed, of the manifest's size (and, deep, checksum), naming only listed tensors."""
    listed = committed.listed(name)
    path = os.path.join(root, listed.file.state_file)
    state = read_sidecar(path, listed, verify=deep)
    if progress is not None:
        progress(listed.file.state_size, 0)
    codec.check(state, listed.tensors, where=path)


def problem_of(root: str, checkpoint: str, exc: CheckpointError) -> Problem:
    """A ``CheckpointError`` that names a file under ``root`` first, as a ``Problem`` of that file
    (for checks above the engine's, such as an adapter's)."""
    text = str(exc)
    head, sep, rest = text.partition(": ")
    base = resolve_root(root) + os.sep
    if sep and head.startswith(base):
        return Problem(checkpoint, head[len(base):], rest)
    return Problem(checkpoint, f"{checkpoint}/", text)


def checkpoints_under(root: str) -> list[str]:
    """Directories under ``root`` that hold a manifest (readable or not), by name."""
    try:
        names = checkpoint_dirs(root)
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot be listed: {exc.strerror or exc}") from None
    return sorted(n for n in names if manifest_exists(os.path.join(root, n)))


def verify_root(root: str, iteration_checkpoint: str | None = None, deep: bool = True,
                progress: "Callable[[int, int], None] | None" = None) -> tuple[list[str], list[Problem]]:
    """(checkpoints checked, problems): one checkpoint if named, else every committed one."""
    if not (is_object_url(root) or os.path.isdir(root)):
        raise CheckpointError(f"{root} is not a directory")
    if iteration_checkpoint is not None and not valid_name(iteration_checkpoint):
        raise CheckpointError(f"{iteration_checkpoint!r} is not a checkpoint name (one directory name under {root})")
    names = [iteration_checkpoint] if iteration_checkpoint is not None else checkpoints_under(root)
    problems: list[Problem] = []
    for name in names:
        problems += verify_checkpoint(root, name, deep, progress)
    return names, problems
