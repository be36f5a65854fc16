"""Shard ownership from megatron-core's sharded state dicts: every shard written once, by one rank.

megatron-core describes each piece of state as a ``ShardedTensor`` / ``ShardedObject`` with a
global key and offset and a ``replica_id``; a replica whose id is all zeros is the main copy.
Writing only main copies would put every data-parallel-replicated tensor (all model weights) on
data-parallel rank 0. Instead, replicas that differ only in their data-parallel component (the
last entry of ``replica_id``) are *candidates*, and each shard goes to one candidate chosen by a
greedy balance of bytes, computed identically on every rank of the data-parallel group from one
``all_gather_object`` at the first checkpoint. Tensor-parallel replicas (non-zero middle
entries) are never candidates. Shards held by one data-parallel rank only (the distributed
optimizer's per-rank state) are written by that rank, with no gather.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor

from megatron_ext.engine.format.codec import Frozen
from megatron_ext.engine.save.flow.file_plan import tensor_signatures


@dataclasses.dataclass
class FlatShardedTensor(ShardedTensor):
    """A ShardedTensor whose ``data`` is the slice ``flattened_range`` of its flattened box.

    That is what the distributed optimizer holds per data-parallel rank: a contiguous slice of
    each parameter. megatron-core 0.19.0 rejects ``flattened_range`` in ``ShardedTensor`` (so its
    own ``fully_sharded_model_space`` optimizer format fails); this subclass checks it instead.
    """

    def validate_metadata_integrity(self) -> None:
        rng = self.flattened_range
        if rng is None or not 0 <= rng.start <= rng.stop <= math.prod(self.local_shape):
            raise CheckpointingException(f"flattened range {rng} outside the box {self.local_shape} of {self.key}")
        if self.data is not None and (self.data.dtype != self.dtype or self.data.shape != (rng.stop - rng.start,)):
            raise CheckpointingException(f"{self.key}: data {self.data.dtype} {tuple(self.data.shape)} does not match "
                                         f"{self.dtype} and the flattened range {rng}")
        if not (len(self.local_shape) + self.prepend_axis_num == len(self.global_shape) == len(self.global_offset)):
            raise CheckpointingException(f"{self.key}: local shape, prepended axes and global shape disagree")


def flat_shard(model_shard: ShardedTensor, key: str, data: torch.Tensor, flattened_range: slice,
               replica_id: Any) -> FlatShardedTensor:
    """``data`` (a flat slice of ``model_shard``'s box) described with that box's global placement."""
    fields = {f.name: getattr(model_shard, f.name) for f in dataclasses.fields(ShardedTensor)}
    fields.update(key=key, data=data, dtype=data.dtype, flattened_range=flattened_range, replica_id=replica_id)
    return FlatShardedTensor(**fields)


def shard_id(shard: ShardedBase) -> str:
    """A stable, readable id of a shard's data: the same on every rank that holds a replica."""
    offset = ",".join(str(o) for o in shard.global_offset)
    sid = f"{shard.key}@{offset}"
    if isinstance(shard, ShardedTensor) and shard.flattened_range is not None:
        sid += f"#{shard.flattened_range.start}:{shard.flattened_range.stop}"
    return sid


def replica_tuple(replica_id: Any) -> tuple[int, ...]:
    return (int(replica_id),) if isinstance(replica_id, int) else tuple(int(r) for r in replica_id)


def is_candidate(shard: ShardedBase) -> bool:
    """Main replica up to the data-parallel component (the last entry of ``replica_id``)."""
    return all(r == 0 for r in replica_tuple(shard.replica_id)[:-1])


def shard_nbytes(shard: ShardedBase) -> int:
    if isinstance(shard, ShardedTensor) and shard.data is not None:
        return shard.data.numel() * shard.data.element_size()
    return 64  # objects are small; a nominal size still spreads them over ranks


def shard_meta(shard: ShardedBase) -> dict:
    """What a loader needs to place a shard in its global tensor (recorded at save time)."""
    meta = {"key": shard.key, "global_shape": list(shard.global_shape),
            "global_offset": list(shard.global_offset)}
    if isinstance(shard, ShardedTensor):
        meta.update(local_shape=list(shard.local_shape), dtype=str(shard.dtype).removeprefix("torch."),
                    axis_fragmentations=list(shard.axis_fragmentations or ()),
                    prepend_axis_num=shard.prepend_axis_num)
        if shard.flattened_range is not None:
            meta["flattened_range"] = [shard.flattened_range.start, shard.flattened_range.stop]
    return meta


def sharded_leaves(sharded: Any) -> Iterable[ShardedBase]:
    if isinstance(sharded, dict):
        for value in sharded.values():
            yield from sharded_leaves(value)
    elif isinstance(sharded, list):
        for value in sharded:
            yield from sharded_leaves(value)
    elif isinstance(sharded, ShardedBase):
        yield sharded


@dataclasses.dataclass
class OwnershipPlan:
    """Which shard ids this rank writes, decided once per process (the layout does not change)."""

    signature: tuple[tuple[str, int], ...]
    owned: frozenset[str]
    bytes_by_dp_rank: list[int]


def candidate_signature(shards: list[ShardedBase]) -> tuple[tuple[str, int], ...]:
    """(shard id, bytes) of the shards this rank could write: what ownership is planned from."""
    return tuple(sorted({(shard_id(s), shard_nbytes(s)) for s in shards if is_candidate(s)}))


def plan_ownership(shards: list[ShardedBase], dp_rank: int, dp_size: int, gather) -> OwnershipPlan:
    """``gather(obj) -> list`` all-gathers over the data-parallel group (a collective)."""
    candidates = list(candidate_signature(shards))
    everyone = gather(candidates) if dp_size > 1 else [candidates]
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for rank, listed in enumerate(everyone):
        for sid, nbytes in listed:
            holders.setdefault(sid, []).append(rank)
            size[sid] = max(size.get(sid, 0), nbytes)
    load = [0] * len(everyone)
    owned = set()
    # Largest first, ties by id: every rank computes the same assignment from the same input.
    for sid in sorted(holders, key=lambda s: (-size[s], s)):
        owner = min(holders[sid], key=lambda r: (load[r], r))
        load[owner] += size[sid]
        if owner == dp_rank:
            owned.add(sid)
    return OwnershipPlan(signature=tuple(candidates), owned=frozenset(owned), bytes_by_dp_rank=load)


def split_owned(shards: list[ShardedBase], plan: OwnershipPlan) -> tuple[dict, dict, dict]:
    """(tensors, objects, metadata) of the shards this rank writes, keyed by shard id."""
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    meta: dict[str, dict] = {}
    for shard in shards:
        sid = shard_id(shard)
        if sid not in plan.owned or not is_candidate(shard) or sid in meta:
            continue
        meta[sid] = shard_meta(shard)
        if isinstance(shard, ShardedObject):
            objects[sid] = shard.data
        else:
            tensors[sid] = shard.data
    return tensors, objects, meta


# ---------------------------------------------------------------------------- what a save of the same structure keeps
_FIELDS: dict[type, tuple[str, ...]] = {}


def leaf_fields(leaf: ShardedBase) -> tuple[str, ...]:
    """A leaf's dataclass fields but ``data`` (what places it, not what it holds)."""
    cls = type(leaf)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.name != "data")
    return names


def leaf_signature(leaves: list[ShardedBase], known: frozenset[int] = frozenset()) -> tuple | None:
    """The exact structure of ``leaves``: each one's class and fields but its data, and of each
    ShardedTensor's data its memory and layout (``file_plan.tensor_signatures``); None when it
    cannot be kept (a leaf that is not a plain ShardedTensor or ShardedObject, such as a factory,
    whose build functions are new at every call, or data the signature does not cover).

    Two saves with equal signatures place the same shard ids, sizes and metadata, and each
    ShardedTensor's data is the same memory: what the ownership plan and the owned split read.
    ``known``: ids of leaves whose fields and data the caller vouches for (the optimizer leaves
    ``optimizer_state`` keeps, checked by their own key, the same objects again): they stand for
    themselves. The ``KeptSplit`` made from these leaves holds them, so their ids stay theirs.
    """
    described = []
    tensors = []
    for leaf in leaves:
        if id(leaf) in known:
            described.append(id(leaf))
            continue
        cls = type(leaf)
        if cls is ShardedObject:
            described.append((cls, *[getattr(leaf, n) for n in leaf_fields(leaf)]))
        elif isinstance(leaf, ShardedTensor) and isinstance(leaf.data, torch.Tensor):
            described.append((cls, *[getattr(leaf, n) for n in leaf_fields(leaf)]))
            tensors.append(("", leaf.data))
        else:
            return None
    memory = tensor_signatures(tensors)
    return None if memory is None else (tuple(described), memory)


@dataclasses.dataclass(eq=False)
class KeptSplit:
    """The owned split of a save (``split_owned``), kept for the next save of the same structure.

    ``key``: the leaves' ``leaf_signature`` and whatever else produced them (the optimizer state's
    ``KeptParamState`` token). The tensors are kept as they were (views of the same memory, which
    the equal signature guarantees); what a leaf holds that is not its memory is taken from the new
    leaves: each owned ShardedObject's value, and the data of shards copied at each save (module
    buffers, ``core_state.copy_buffers_now``), by their place in the leaf list.
    """

    key: tuple
    tensors: dict[str, torch.Tensor]
    objects: dict[str, int]  # shard id -> its leaf's index
    copied: dict[str, int]  # shard id -> its leaf's index (copied at each save)
    meta: Frozen  # the shards' metadata (``shard_meta``), never changed again: the engine reuses its encoding
    leaves: list[ShardedBase]  # held: the ids ``leaf_signature`` took as known stay theirs
    whole: tuple | None = None  # the tokens of the kept parts these leaves are, all of them (``owned``)

    def split(self, leaves: list[ShardedBase]) -> tuple[dict | Frozen, dict, Frozen]:
        """The owned split of ``leaves`` (the same structure): its tensors as one ``Frozen`` (the same
        tensor objects at every save: the engine reuses their encoding) unless buffers are copied."""
        objects = {sid: leaves[index].data for sid, index in self.objects.items()}
        if not self.copied:
            return self.stored, objects, self.meta
        tensors = dict(self.tensors)
        for sid, index in self.copied.items():
            tensors[sid] = leaves[index].data.clone()
        return tensors, objects, self.meta

    @functools.cached_property
    def stored(self) -> Frozen:
        return Frozen(self.tensors)


def keep_split(key: tuple, leaves: list[ShardedBase], tensors: dict, objects: dict, meta: dict,
               copied: set[str], whole: tuple | None = None) -> KeptSplit | None:
    """``split_owned``'s result as a ``KeptSplit`` (``copied``: the shard ids copied at this save;
    ``whole``: the tokens of the kept parts that are all of ``leaves``), or None if an owned object
    is not one of ``leaves`` (the same object)."""
    index = {}
    for i, leaf in enumerate(leaves):
        sid = shard_id(leaf)
        if sid in meta and sid not in index:
            index[sid] = i
    if any(sid not in index or leaves[index[sid]].data is not objects[sid] for sid in objects):
        return None
    return KeptSplit(key, dict(tensors), {sid: index[sid] for sid in objects}, {sid: index[sid] for sid in copied},
                     Frozen(meta), list(leaves), whole)
