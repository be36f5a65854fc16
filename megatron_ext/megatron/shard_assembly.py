"""Any box of a saved global tensor, assembled from the shards a checkpoint holds, whatever layout wrote them.

A checkpoint written by ``checkpointing.save_checkpoint`` stores each shard once, with the
metadata of ``sharding.shard_meta`` in its rank file's sidecar (``shards/meta``): the global
``key``, ``global_shape``, the ``global_offset`` and ``local_shape`` of its box (plus
``prepend_axis_num`` leading axes of size 1), its ``dtype`` and, for a piece of a flattened box
(the distributed optimizer's per-data-parallel-rank slices), ``flattened_range``. A box of the
global tensor is assembled from the saved boxes that overlap it; the flattened pieces of one
saved box are first joined (all data-parallel slices of a parameter together cover its box).
Only overlapping tensors are read, each verified against the manifest by the engine's reader.

Public API (stable; used by resharded loads and by the consolidated export)::

    shards = SavedShards(committed)        # committed: CheckpointEngine.open_checkpoint(...)
    shards.keys() -> list[str]             # global tensor keys, sorted
    shards.global_shape(key) -> tuple[int, ...]
    shards.dtype(key) -> torch.dtype       # dtype as saved
    shards.read_box(key, offset, shape) -> torch.Tensor
        # the dense box global[offset[i]:offset[i]+shape[i], ...] (global rank, saved dtype)
    shards.read_global(key) -> torch.Tensor
        # the whole global tensor
    shards.read_shard(key, global_offset, local_shape, prepend_axis_num=0, flattened_range=None)
        # what a ShardedTensor with this metadata holds as ``data``: the box reshaped to
        # ``local_shape``, or its flattened slice ``flattened_range`` (a slice or (start, stop))

Every method raises ``CheckpointError`` for an unknown key, a box outside the global shape, or a
box the saved shards do not cover completely.

The shard metadata is as untrusted as the rest of the checkpoint: every entry is validated when
the index is built (a name for ``key``, whole numbers that fit an int64 for shapes and offsets,
the box inside the global shape, a known dtype, a flat range inside its box), each saved tensor is
held to its metadata (dtype, element count) before it is used, and a box is planned (its pieces
checked, disjoint, covering it) before any memory is allocated for it: a global shape of
10**12 elements with one small shard is an error, not an allocation. ``check()`` does all of it
for every key without reading data (``verify``, ``convert``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import torch

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.format.tensor_file import INT64_MAX, TORCH_DTYPES, shape_elements
from megatron_ext.engine.read.committed import CommittedCheckpoint, ReadOptions, open_committed
from megatron_ext.engine.read.verify import Problem, problem_of
from megatron_ext.megatron.checkpoint_layout import is_datastates_checkpoint, is_megatron_checkpoint

#: The dtypes shard metadata may name (``str(dtype)`` without ``torch.``): a fixed table, no
#: attribute of ``torch`` is looked up by a name from the checkpoint.
SHARD_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in TORCH_DTYPES.values()}


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One saved tensor: its file, its name there, the global box it belongs to, its flat slice."""

    file: str
    tensor: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]  # box shape in the global rank (prepended axes have size 1)
    flat: tuple[int, int] | None  # slice of the flattened box this piece holds; None = the whole box
    where: str = ""  # the sidecar holding its metadata, for messages
    sid: str = ""

    @property
    def elements(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(self.shape)


@dataclasses.dataclass
class _Key:
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    dense: list[_Piece] = dataclasses.field(default_factory=list)
    flat: dict[tuple, list[_Piece]] = dataclasses.field(default_factory=dict)  # (offset, shape) -> pieces
    sources: set[str] = dataclasses.field(default_factory=set)  # sidecars describing its shards


def _whole_numbers(value, what: str, where: str) -> tuple[int, ...]:
    if type(value) not in (list, tuple) or not all(type(n) is int and 0 <= n <= INT64_MAX for n in value):
        raise CheckpointError(f"{where}: {what} {str(value)[:80]} is not a list of whole numbers >= 0 that fit "
                              "an int64")
    return tuple(value)


def check_shard_meta(meta, tensor: bool, where: str) -> dict:
    """One shard's metadata (``sharding.shard_meta``) with every number bounded; ``where`` names the
    sidecar and the shard. ``tensor``: a ShardedTensor's (else a ShardedObject's: key and placement)."""
    if type(meta) is not dict or "key" not in meta:
        raise CheckpointError(f"{where}: has no key (its metadata is {str(meta)[:80]})")
    if type(meta["key"]) is not str or not meta["key"]:
        raise CheckpointError(f"{where}: key {meta['key']!r} is not a name")
    global_shape = _whole_numbers(meta.get("global_shape"), "global_shape", where)
    offset = _whole_numbers(meta.get("global_offset"), "global_offset", where)
    if len(offset) != len(global_shape):
        raise CheckpointError(f"{where}: global_offset {list(offset)} does not match global_shape {list(global_shape)}")
    if not tensor:
        return {"key": meta["key"], "global_shape": list(global_shape), "global_offset": list(offset)}
    dtype = meta.get("dtype")
    if type(dtype) is not str or dtype not in SHARD_DTYPES:
        raise CheckpointError(f"{where}: dtype {str(dtype)[:40]!r} is not one of {sorted(SHARD_DTYPES)}")
    itemsize = SHARD_DTYPES[dtype].itemsize
    local = _whole_numbers(meta.get("local_shape"), "local_shape", where)
    prepend = meta.get("prepend_axis_num", 0)
    if type(prepend) is not int or not 0 <= prepend <= len(global_shape):
        raise CheckpointError(f"{where}: prepend_axis_num {prepend!r} is not in [0, {len(global_shape)}]")
    box = (1,) * prepend + local
    try:
        shape_elements(list(global_shape), itemsize)
        elements = shape_elements(list(box), itemsize)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    if len(box) != len(global_shape) or any(o + n > g for o, n, g in zip(offset, box, global_shape)):
        raise CheckpointError(f"{where}: its box at {list(offset)} of shape {list(box)} is outside the global shape "
                              f"{list(global_shape)}")
    flat = meta.get("flattened_range")
    if flat is not None:
        flat = _whole_numbers(flat, "flattened_range", where)
        if len(flat) != 2 or not flat[0] <= flat[1] <= elements:
            raise CheckpointError(f"{where}: flattened_range {list(flat)} is not a slice of its box's {elements} "
                                  "elements")
    fragments = meta.get("axis_fragmentations")
    if fragments is not None:
        fragments = _whole_numbers(fragments, "axis_fragmentations", where)
        if 0 in fragments or len(fragments) > len(global_shape):
            raise CheckpointError(f"{where}: axis_fragmentations {list(fragments)} do not fit global_shape "
                                  f"{list(global_shape)}")
    return dict(meta, global_shape=list(global_shape), global_offset=list(offset), local_shape=list(local),
                prepend_axis_num=prepend, flattened_range=list(flat) if flat is not None else None,
                axis_fragmentations=list(fragments) if fragments is not None else None)


def _intersect(off_a: Sequence[int], shape_a: Sequence[int], off_b: Sequence[int],
               shape_b: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Offset and shape of the intersection of two boxes, or None if it is empty."""
    lo = tuple(max(a, b) for a, b in zip(off_a, off_b))
    hi = tuple(min(a + sa, b + sb) for a, sa, b, sb in zip(off_a, shape_a, off_b, shape_b))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _slices(offset: Sequence[int], shape: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + s) for o, s, b in zip(offset, shape, origin))


def _rows(box_offset: Sequence[int], box_shape: Sequence[int], hit: tuple) -> tuple[int, int, int, int]:
    """(axis, first row, rows, elements per row) of a flattened box that ``hit`` (offset, shape) needs."""
    axis = _row_axis(box_shape)
    return axis, hit[0][axis] - box_offset[axis], hit[1][axis], math.prod(box_shape[axis + 1:])


def _covering(key: str, entry: "_Key", pieces: list[_Piece], start: int, stop: int) -> list[tuple[_Piece, int, int]]:
    """``(piece, lo, hi)``: which flat piece of one saved box supplies its elements ``lo:hi``, in
    order, together exactly ``start:stop``; a gap is an error."""
    cursor, found = start, []
    for piece in sorted(pieces, key=lambda p: p.flat):
        begin, end = piece.flat
        if end <= cursor or begin >= stop:
            continue
        if begin > cursor:
            break
        found.append((piece, cursor, min(end, stop)))
        cursor = min(end, stop)
    if cursor < stop:
        raise CheckpointError(f"{_sources(entry)}: {key}: the saved slices of the box at {pieces[0].offset} do not "
                              f"cover flat elements {cursor}:{stop}")
    return found


def _sources(entry: "_Key") -> str:
    """The sidecars that describe a key's shards, for messages."""
    names = sorted(entry.sources)
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _row_axis(box: Sequence[int]) -> int:
    """The axis whose index is a row number when reading contiguous flat spans of a box.

    It is the first axis of size > 1 (the ones before it have size 1), so rows
    ``[r0, r1)`` along it are the contiguous flat elements ``[r0 * row, r1 * row)`` with
    ``row = prod(box[axis + 1:])``. Only for boxes of rank >= 1.
    """
    return next((i for i, n in enumerate(box) if n > 1), len(box) - 1)


class SavedShards:
    """Index of the tensor shards of one committed checkpoint, and reads of any box of them."""

    def __init__(self, committed: CommittedCheckpoint):
        self.committed = committed
        self._keys: dict[str, _Key] = {}
        self._meta: list[tuple[str, str, dict]] = []  # (file, shard id, validated metadata), tensors and objects
        self._checked: set[_Piece] = set()  # pieces whose saved tensor matches their metadata
        for file_name in (file.name for file in committed.files()):
            reader = committed.reader(file_name)
            skeleton = reader.skeleton()
            shards = skeleton.get("shards") if isinstance(skeleton, dict) else None
            if not shards:
                continue
            tensors = shards.get("tensors", {}) if type(shards) is dict else None
            meta = reader.part("shards", "meta")
            if type(tensors) is not dict or type(meta) is not dict:
                raise CheckpointError(f"{reader.state_path}: shards/tensors and shards/meta must be objects")
            validated = {sid: check_shard_meta(entry, sid in tensors, f"{reader.state_path}: shard {sid!r}")
                         for sid, entry in meta.items()}
            self._meta += [(file_name, sid, m) for sid, m in validated.items()]
            for sid, tensor_ref in tensors.items():
                if sid not in validated:
                    raise CheckpointError(f"{reader.state_path}: shard {sid!r} has no metadata")
                if type(tensor_ref) is not dict or type(tensor_ref.get("$t")) is not str:
                    raise CheckpointError(f"{reader.state_path}: shard {sid!r} is not a tensor reference")
                self._add(file_name, tensor_ref["$t"], sid, validated[sid], reader.state_path)

    def _add(self, file_name: str, tensor_name: str, sid: str, meta: dict, where: str) -> None:
        key = meta["key"]
        global_shape = tuple(meta["global_shape"])
        dtype = SHARD_DTYPES[meta["dtype"]]
        entry = self._keys.setdefault(key, _Key(global_shape, dtype))
        if entry.global_shape != global_shape or entry.dtype != dtype:
            raise CheckpointError(f"{where}: shard {sid!r}: global shape {global_shape} / {dtype} disagrees with other "
                                  f"shards of {key} ({entry.global_shape} / {entry.dtype})")
        shape = (1,) * meta["prepend_axis_num"] + tuple(meta["local_shape"])
        offset = tuple(meta["global_offset"])
        flat = tuple(meta["flattened_range"]) if meta["flattened_range"] is not None else None
        piece = _Piece(file_name, tensor_name, offset, shape, flat, where, sid)
        entry.sources.add(where)
        if flat is None:
            entry.dense.append(piece)
        else:
            entry.flat.setdefault((offset, shape), []).append(piece)

    def shard_meta(self) -> list[tuple[str, str, dict]]:
        """(file, shard id, metadata) of every saved shard, tensors and objects, each validated."""
        return list(self._meta)

    def check(self) -> None:
        """Without reading data: every key's global shape is exactly covered by its saved shards, each
        saved tensor matching its metadata (what ``read_global`` would find, for ``verify``)."""
        for key, entry in self._keys.items():
            self._plan_box(key, entry, (0,) * len(entry.global_shape), entry.global_shape)

    # ------------------------------------------------------------------ description
    def keys(self) -> list[str]:
        return sorted(self._keys)

    def _entry(self, key: str) -> _Key:
        try:
            return self._keys[key]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.committed.checkpoint} has no tensor {key!r}") from None

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).global_shape

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    # ------------------------------------------------------------------ reads
    def read_global(self, key: str) -> torch.Tensor:
        shape = self.global_shape(key)
        return self.read_box(key, (0,) * len(shape), shape)

    def read_box(self, key: str, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        entry = self._entry(key)
        offset, shape = tuple(int(o) for o in offset), tuple(int(s) for s in shape)
        if len(offset) != len(entry.global_shape) or len(shape) != len(entry.global_shape) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offset, shape, entry.global_shape)):
            raise CheckpointError(f"{key}: box at {offset} of shape {shape} is outside the global shape "
                                  f"{entry.global_shape}")
        plan = self._plan_box(key, entry, offset, shape)  # checked and covered before anything is allocated
        out = torch.empty(shape, dtype=entry.dtype)
        for piece, pieces, hit in plan:
            if piece is not None:
                source = self._tensor(piece, math.prod(piece.shape)).view(piece.shape)
                out[_slices(*hit, offset)] = source[_slices(*hit, piece.offset)]
                continue
            box_offset, box_shape = pieces[0].offset, pieces[0].shape
            if not box_shape:  # a 0-dim tensor saved as a one-element flat piece
                out[()] = self._flat_span(key, pieces, 0, 1)[0]
                continue
            axis, first, count, row = _rows(box_offset, box_shape, hit)
            span = self._flat_span(key, pieces, first * row, (first + count) * row)
            rows_shape = box_shape[:axis] + (count,) + box_shape[axis + 1:]
            rows_origin = tuple(o + (first if i == axis else 0) for i, o in enumerate(box_offset))
            out[_slices(*hit, offset)] = span.view(rows_shape)[_slices(*hit, rows_origin)]
        return out

    def _plan_box(self, key: str, entry: _Key, offset: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple]:
        """The saved pieces of ``key`` a box needs: ``(piece, None, hit)`` for a dense one, ``(None,
        pieces, hit)`` for a flattened box; each saved tensor held to its metadata, the hits disjoint
        and covering the box. Nothing is read or allocated here."""
        plan: list[tuple] = []
        for piece in entry.dense:
            hit = _intersect(offset, shape, piece.offset, piece.shape)
            if hit is not None:
                self._check_piece(key, entry, piece)
                plan.append((piece, None, hit))
        for (box_offset, box_shape), pieces in entry.flat.items():
            hit = _intersect(offset, shape, box_offset, box_shape)
            if hit is None:
                continue
            if box_shape:
                _, first, count, row = _rows(box_offset, box_shape, hit)
                self._check_span(key, entry, pieces, first * row, (first + count) * row)
            else:
                self._check_span(key, entry, pieces, 0, 1)
            plan.append((None, pieces, hit))
        for i, (_, _, a) in enumerate(plan):
            for _, _, b in plan[i + 1:]:
                if _intersect(*a, *b) is not None:
                    raise CheckpointError(f"{_sources(entry)}: {key}: saved shards overlap at {a[0]} and {b[0]}")
        covered, wanted = sum(math.prod(hit[1]) for _, _, hit in plan), math.prod(shape)
        if covered != wanted:
            raise CheckpointError(f"{_sources(entry)}: {key}: the saved shards cover {covered} of the {wanted} elements "
                                  f"of the box at {offset} of shape {shape} (global shape {entry.global_shape})")
        return plan

    def _check_piece(self, key: str, entry: _Key, piece: _Piece) -> None:
        """The saved tensor is what the metadata says: its dtype and element count (from the tensor index)."""
        if piece in self._checked:
            return
        saved = self.committed.tensors(piece.file).get(piece.tensor)
        if saved is None:
            raise CheckpointError(f"{piece.where}: shard {piece.sid!r} refers to tensor {piece.tensor!r}, which "
                                  f"{self.committed.file(piece.file).tensor_file} lacks")
        if saved.dtype != entry.dtype:
            raise CheckpointError(f"{piece.where}: shard {piece.sid!r}: its tensor is saved as "
                                  f"{str(saved.dtype).removeprefix('torch.')}, its metadata says "
                                  f"{str(entry.dtype).removeprefix('torch.')}")
        if saved.numel != piece.elements:
            raise CheckpointError(f"{piece.where}: shard {piece.sid!r}: its tensor holds {saved.numel} "
                                  f"elements, its metadata describes {piece.elements}")
        self._checked.add(piece)

    def _check_span(self, key: str, entry: _Key, pieces: list[_Piece], start: int, stop: int) -> None:
        """The flat pieces of one box cover its elements ``start:stop``, each matching its metadata."""
        for piece, _, _ in _covering(key, entry, pieces, start, stop):
            self._check_piece(key, entry, piece)

    def read_shard(self, key: str, global_offset: Sequence[int], local_shape: Sequence[int],
                   prepend_axis_num: int = 0, flattened_range: slice | Sequence[int] | None = None) -> torch.Tensor:
        box = (1,) * prepend_axis_num + tuple(int(s) for s in local_shape)
        if flattened_range is None:
            return self.read_box(key, global_offset, box).view(tuple(local_shape))
        start, stop = ((flattened_range.start, flattened_range.stop) if isinstance(flattened_range, slice)
                       else tuple(flattened_range))
        if not 0 <= start <= stop <= math.prod(box):
            raise CheckpointError(f"{key}: flattened range {start}:{stop} is outside the box of "
                                  f"{math.prod(box)} elements")
        if start == stop:
            return torch.empty(0, dtype=self.dtype(key))
        if not box:
            return self.read_box(key, global_offset, ()).reshape(-1)[start:stop].clone()
        axis = _row_axis(box)
        row = math.prod(box[axis + 1:])
        first, last = start // row, -(-stop // row)
        sub_offset = tuple(o + (first if i == axis else 0) for i, o in enumerate(global_offset))
        sub_shape = box[:axis] + (last - first,) + box[axis + 1:]
        rows = self.read_box(key, sub_offset, sub_shape).reshape(-1)
        return rows[start - first * row:stop - first * row].clone()

    def _flat_span(self, key: str, pieces: list[_Piece], start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of a flattened saved box, joined from the pieces that overlap them."""
        entry = self._keys[key]
        out = torch.empty(stop - start, dtype=entry.dtype)
        for piece, lo, hi in _covering(key, entry, pieces, start, stop):
            begin = piece.flat[0]
            out[lo - start:hi - start] = self._tensor(piece, piece.elements)[lo - begin:hi - begin]
        return out

    def _tensor(self, piece: _Piece, numel: int) -> torch.Tensor:
        tensor = self.committed.reader(piece.file).tensor(piece.tensor)
        if tensor.numel() != numel:
            raise CheckpointError(f"{piece.file}: tensor {piece.tensor!r} has {tensor.numel()} elements, its "
                                  f"metadata says {numel}")
        return tensor.reshape(-1) if piece.flat is not None else tensor


def shard_problems(root: str, checkpoint: str) -> list[Problem]:
    """``verify``'s part for a Megatron checkpoint (every file written by this adapter): what
    ``export``, ``convert`` or a resharded load would refuse in its shard metadata, found without
    reading tensor data. Run on a checkpoint the engine's checks passed."""
    if not is_datastates_checkpoint(os.path.join(root, checkpoint)):
        return []  # not committed: nothing of this adapter's to check
    committed = open_committed(root, checkpoint, ReadOptions(verify=False))
    if not is_megatron_checkpoint(committed.files()):
        return []
    try:
        SavedShards(committed).check()
    except CheckpointError as exc:
        return [problem_of(root, checkpoint, exc)]
    return []


__all__ = ["SavedShards", "check_shard_meta", "shard_problems"]
