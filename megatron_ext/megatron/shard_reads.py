"""The shard reads of a Megatron-LM load: every leaf of the load template's sharded state dict
replaced by the saved value of its shard.

On the saved layout each shard is read by id (``shard_index``), the live tensors (the model's
parameters, the optimizer's main params and moments) filled in place; on another layout each is
assembled from the saved shards that overlap it (``shard_assembly.SavedShards``). A shard that
does not fit the model is a ``ModelMismatch``: the checkpoint is intact, no older one would fit
better.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_ext.engine.errors import CheckpointError
from megatron_ext.engine.format.entries import TensorEntry
from megatron_ext.engine.read.committed import CommittedCheckpoint
from megatron_ext.megatron import sharding
from megatron_ext.megatron.shard_assembly import SavedShards

log = logging.getLogger("megatron_ext.megatron")

TENSOR_PREFIX = "shards/tensors/"


class ModelMismatch(CheckpointError):
    """The checkpoint is intact but was saved from another model (shapes, keys, kind) or cannot go on
    with this run's settings: not a damaged one (every older checkpoint of the run would fail the same)."""


def shard_index(ckpt: CommittedCheckpoint) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """Shard id -> (file, tensor name) for tensors and -> file for objects, over all ranks' files.

    A shard id claimed twice is an error, never a silent choice between two files.
    """
    tensors: dict[str, tuple[str, str]] = {}
    objects: dict[str, str] = {}
    for entry in ckpt.files():
        name = entry.name
        for tensor_name in ckpt.index.tensors(name):
            if tensor_name.startswith(TENSOR_PREFIX):
                sid = tensor_name[len(TENSOR_PREFIX):]
                if sid in tensors:
                    raise CheckpointError(f"{ckpt.checkpoint}: shard {sid!r} is in files {tensors[sid][0]!r} "
                                          f"and {name!r}")
                tensors[sid] = (name, tensor_name)
        extra = entry.extra if entry.extra is not None else {}
        listed = extra.get("objects", []) if isinstance(extra, dict) else None
        if type(listed) is not list or not all(type(sid) is str for sid in listed):
            raise CheckpointError(f"{ckpt.checkpoint}: file {name!r} has a malformed extra.objects list")
        for sid in listed:
            if sid in objects:
                raise CheckpointError(f"{ckpt.checkpoint}: object shard {sid!r} is in files {objects[sid]!r} "
                                      f"and {name!r}")
            objects[sid] = name
    return tensors, objects


def reshard_source(ckpt: CommittedCheckpoint, saved: dict, current: dict) -> SavedShards | None:
    """The saved shards to assemble from when the parallel layout changed; None when it did not."""
    differ = [f"{k.upper()} {saved.get(k)} -> {current.get(k)}" for k in ("tp", "pp", "dp")
              if saved.get(k) != current.get(k)]
    if not differ:
        return None
    if torch.distributed.get_rank() == 0:
        log.warning("[datastates] resharding %s: parallel layout %s; every shard is assembled from the saved "
                    "ones that overlap it", ckpt.checkpoint, ", ".join(differ))
    return SavedShards(ckpt)


def fill_sharded(ckpt: CommittedCheckpoint, sharded: Any, tensor_index: dict[str, tuple[str, str]],
                 object_index: dict[str, str], saved_shards: SavedShards | None,
                 boxes: SavedShards | None) -> dict[int, str]:
    """Replace, in place, every ShardedTensor and ShardedObject of ``sharded`` by its loaded value.

    ``saved_shards``: the source when resharding (None on the saved layout); ``boxes``: the
    optimizer's whole parameter boxes when the checkpoint holds them (converted from
    fully_reshardable: each rank's slices are cut from them). Returns id of each loaded object ->
    its file and shard id, for the messages of later checks.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    missing: list[str] = []
    prefetched = {} if saved_shards is not None else _read_own_shards(ckpt, tensor_index, sharded)
    object_sources: dict[int, str] = {}

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, (ShardedTensor, ShardedObject)):
            return leaf
        sid = sharding.shard_id(leaf)
        if isinstance(leaf, ShardedObject):
            if sid not in object_index:
                missing.append(sid)
                return None
            reader = ckpt.reader(object_index[sid])
            value = reader.part("shards", "objects", sid)
            path = reader.tensor_path if isinstance(value, torch.Tensor) else reader.state_path
            object_sources[id(value)] = f"{path} (shard {sid})"
            return value
        if saved_shards is not None:
            return _same_kind(sid, _assemble(saved_shards, leaf), leaf)
        if sid not in prefetched:
            if boxes is not None and leaf.key.startswith("optimizer.state."):
                return _same_kind(sid, _assemble(boxes, leaf), leaf)
            missing.append(sid)
            return None
        return _fitted(sid, _same_kind(sid, prefetched[sid], leaf), leaf)

    dict_list_map_inplace(fill, sharded)
    if missing:
        raise ModelMismatch(f"{len(missing)} shard(s) needed by this rank are not in the checkpoint, e.g. "
                            f"{missing[:3]}; was it saved from a different model or parallel layout?")
    return object_sources


def _fitted(sid: str, tensor: torch.Tensor, leaf: Any) -> torch.Tensor:
    """A shard read by id, shaped as the template's; a shard converted from torch_dist keeps megatron-core's
    prepended axes of size 1."""
    expected = tuple(leaf.data.shape) if leaf.data is not None else tuple(leaf.local_shape)
    if tuple(tensor.shape) == expected:
        return tensor
    if [n for n in tensor.shape if n != 1] != [n for n in expected if n != 1]:
        raise ModelMismatch(f"shard {sid}: checkpoint has shape {tuple(tensor.shape)}, the model {expected}")
    return tensor.view(expected)


def _read_own_shards(ckpt: CommittedCheckpoint, tensor_index: dict[str, tuple[str, str]],
                     sharded: Any) -> dict[str, torch.Tensor]:
    """Every tensor shard this rank loads, by shard id: one batched parallel read per file.

    Where the load template's tensor is the live one (the model's parameters, the optimizer's
    main params and moments) and matches the saved dtype and size, the bytes are read straight
    into it, checksums verified there: no fresh memory to fault in, and the later
    ``load_state_dict`` copies find the values already in place. Other shards are read fresh.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    wanted: dict[str, dict[str, str]] = {}  # file -> tensor name -> shard id
    live: dict[str, dict[str, torch.Tensor]] = {}  # file -> tensor name -> live tensor (saved shape)
    found: dict[str, torch.Tensor] = {}
    for leaf in nested_values(sharded):
        if isinstance(leaf, ShardedTensor):
            sid = sharding.shard_id(leaf)
            if sid in tensor_index:
                file_name, tensor_name = tensor_index[sid]
                target = _live_target(ckpt.tensors(file_name)[tensor_name], leaf.data)
                if target is not None:
                    live.setdefault(file_name, {})[tensor_name] = target
                    found[sid] = leaf.data
                else:
                    wanted.setdefault(file_name, {})[tensor_name] = sid
    # The file with the most of this rank's bytes (its own) first: ranks of one node then find the
    # few bytes they need from the others' files (the replicated model weights) in the page cache,
    # read by their owners meanwhile, instead of each reading them from the disk again.
    for file_name, targets in sorted(live.items(), key=lambda item: -sum(t.nbytes for t in item[1].values())):
        ckpt.reader(file_name).read_into(targets)
    for file_name, names in wanted.items():
        for tensor_name, tensor in ckpt.reader(file_name).tensors(names).items():
            found[names[tensor_name]] = tensor
    return found


def _same_kind(sid: str, tensor: torch.Tensor, leaf: Any) -> torch.Tensor:
    """A model-space optimizer shard loads only into a tensor of its saved dtype: never int16 remainders into fp32.

    (Model weights may be cast, as in Megatron-LM's own load.) Checkpoints record the optimizer's
    stored form and ``check_stored_form`` refuses another one first; this also holds for those
    saved before the record existed.
    """
    if leaf.key.startswith("optimizer.state.") and tensor.dtype != leaf.dtype:
        raise CheckpointError(f"optimizer shard {sid}: the checkpoint holds {tensor.dtype}, this run's optimizer keeps "
                              f"{leaf.dtype} there; it was saved by an optimizer that stores its state in another form "
                              "(--use-precision-aware-optimizer, --main-params-dtype, --exp-avg-dtype, "
                              "--exp-avg-sq-dtype): resume with the flags it was saved with, or pass --no-load-optim")
    return tensor


def _live_target(saved: TensorEntry, data: Any) -> torch.Tensor | None:
    """``data`` shaped as the saved tensor when the saved bytes can be read straight into it, else None."""
    if not isinstance(data, torch.Tensor) or not data.is_contiguous() or data.dtype != saved.dtype:
        return None
    if data.numel() != saved.numel or data.numel() == 0:
        return None
    return data.view(saved.shape)


def _assemble(saved_shards: SavedShards, leaf: Any) -> torch.Tensor:
    """A ShardedTensor's data in this run's layout, from the saved shards of its key that overlap it."""
    if saved_shards.global_shape(leaf.key) != tuple(leaf.global_shape):
        raise ModelMismatch(f"{leaf.key}: checkpoint has global shape {saved_shards.global_shape(leaf.key)}, "
                            f"the model {tuple(leaf.global_shape)}")
    return saved_shards.read_shard(leaf.key, leaf.global_offset, leaf.local_shape, leaf.prepend_axis_num,
                                   leaf.flattened_range)
