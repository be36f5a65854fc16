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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.engine import CommittedCheckpoint


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One saved tensor: its file, its name there, the global box it belongs to, its flat slice."""

    file: str
    tensor: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]  # box shape in the global rank (prepended axes have size 1)
    flat: tuple[int, int] | None  # slice of the flattened box this piece holds; None = the whole box


@dataclasses.dataclass
class _Key:
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    dense: list[_Piece] = dataclasses.field(default_factory=list)
    flat: dict[tuple, list[_Piece]] = dataclasses.field(default_factory=dict)  # (offset, shape) -> pieces


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the shard metadata")
    return dtype


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
        for file_name in sorted(committed.manifest["files"]):
            skeleton = committed.reader(file_name).skeleton()
            shards = skeleton.get("shards") if isinstance(skeleton, dict) else None
            if not shards:
                continue
            meta = committed.reader(file_name).part("shards", "meta")
            for sid, tensor_ref in shards.get("tensors", {}).items():
                if sid not in meta:
                    raise CheckpointError(f"{file_name}: shard {sid} has no metadata")
                self._add(file_name, tensor_ref["$t"], sid, meta[sid])

    def _add(self, file_name: str, tensor_name: str, sid: str, meta: dict) -> None:
        key = meta["key"]
        global_shape = tuple(meta["global_shape"])
        dtype = _dtype(meta["dtype"])
        entry = self._keys.setdefault(key, _Key(global_shape, dtype))
        if entry.global_shape != global_shape or entry.dtype != dtype:
            raise CheckpointError(f"shard {sid}: global shape {global_shape} / {dtype} disagrees with other "
                                  f"shards of {key} ({entry.global_shape} / {entry.dtype})")
        shape = (1,) * meta.get("prepend_axis_num", 0) + tuple(meta["local_shape"])
        offset = tuple(meta["global_offset"])
        if len(shape) != len(global_shape) or len(offset) != len(global_shape):
            raise CheckpointError(f"shard {sid}: box {offset} + {shape} does not fit rank {len(global_shape)}")
        flat = tuple(meta["flattened_range"]) if meta.get("flattened_range") is not None else None
        piece = _Piece(file_name, tensor_name, offset, shape, flat)
        if flat is None:
            entry.dense.append(piece)
        else:
            entry.flat.setdefault((offset, shape), []).append(piece)

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
        out = torch.empty(shape, dtype=entry.dtype)
        if out.numel() == 0:
            return out
        covered = 0
        for piece in entry.dense:
            hit = _intersect(offset, shape, piece.offset, piece.shape)
            if hit is None:
                continue
            source = self._tensor(piece, math.prod(piece.shape)).view(piece.shape)
            out[_slices(*hit, offset)] = source[_slices(*hit, piece.offset)]
            covered += math.prod(hit[1])
        for (box_offset, box_shape), pieces in entry.flat.items():
            hit = _intersect(offset, shape, box_offset, box_shape)
            if hit is None:
                continue
            if not box_shape:  # a 0-dim tensor saved as a one-element flat piece
                out[()] = self._flat_span(key, pieces, 0, 1)[0]
                covered += 1
                continue
            axis = _row_axis(box_shape)
            first, count = hit[0][axis] - box_offset[axis], hit[1][axis]
            row = math.prod(box_shape[axis + 1:])
            span = self._flat_span(key, pieces, first * row, (first + count) * row)
            rows_shape = box_shape[:axis] + (count,) + box_shape[axis + 1:]
            rows_origin = tuple(o + (first if i == axis else 0) for i, o in enumerate(box_offset))
            source = span.view(rows_shape)
            out[_slices(*hit, offset)] = source[_slices(*hit, rows_origin)]
            covered += math.prod(hit[1])
        if covered != out.numel():
            raise CheckpointError(f"{key}: the saved shards cover {covered} of the {out.numel()} elements of the "
                                  f"box at {offset} of shape {shape}")
        return out

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
        out = torch.empty(stop - start, dtype=self._keys[key].dtype)
        cursor = start
        for piece in sorted(pieces, key=lambda p: p.flat):
            begin, end = piece.flat
            if end <= cursor or begin >= stop:
                continue
            if begin > cursor:
                break
            source = self._tensor(piece, end - begin)
            take_to = min(end, stop)
            out[cursor - start:take_to - start] = source[cursor - begin:take_to - begin]
            cursor = take_to
        if cursor < stop:
            raise CheckpointError(f"{key}: the saved slices of the box at {pieces[0].offset} do not cover "
                                  f"flat elements {cursor}:{stop}")
        return out

    def _tensor(self, piece: _Piece, numel: int) -> torch.Tensor:
        tensor = self.committed.reader(piece.file).tensor(piece.tensor)
        if tensor.numel() != numel:
            raise CheckpointError(f"{piece.file}: tensor {piece.tensor!r} has {tensor.numel()} elements, its "
                                  f"metadata says {numel}")
        return tensor.reshape(-1) if piece.flat is not None else tensor


__all__ = ["SavedShards"]
