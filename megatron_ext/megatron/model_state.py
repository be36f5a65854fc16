"""The model's sharded state at a save, kept for the next save of the same model.

megatron-core's ``sharded_state_dict`` walks every module at every call and builds a new
``ShardedTensor`` per parameter; with ``--save-interval 1`` that was the largest part of the save
call on the training thread, for a result that only changes when the model does. What it reads is
the module tree, the parameters' and buffers' objects and memory (their tensors are the leaves'
data), the content metadata, and each module's extra state (``get_extra_state``, Transformer
Engine's fp8 scaling state), which is new at every call. ``model_state`` keeps the result under a
key of the first three (``_key``) and, on a hit, takes only the extra states anew, into the leaves
that held them; any other change to the key builds it again.

A result is kept only where that is exact: every ``ShardedTensor`` views the memory of one of the
model's parameters or buffers (a leaf that holds a copy would otherwise be saved stale), every
``ShardedObject`` is an extra state whose module is known, and the preprocessing leaves no common
(non-sharded) value. Anything else is built anew at every save, as before.

Megatron-LM's ``--ckpt-assume-constant-structure`` caches its plans on the user's word; here the key
is checked at every save, so a new parameter, a resized one or memory given to another tensor
(``param.data = ...``) takes the full path without a flag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import Any, Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor

from megatron_ext.engine.save.flow.file_plan import tensor_signatures
from megatron_ext.megatron import sharding

__all__ = ["ModelState", "model_state"]

_TOKENS = itertools.count(1)  # a kept state's token: never the same for two builds in a process


@dataclasses.dataclass(eq=False)
class ModelState:
    """The model's sharded state dict of one build, as megatron-core returned it and preprocessed.

    ``raw`` is what the optimizer's model-space view reads (its factories unbuilt); ``sharded`` and
    ``common`` are ``save_preprocess``'s result of it, what the checkpoint holds. ``key`` is None for
    a build that is not kept; otherwise ``token`` stands for its leaves' exact fields and memory (a
    value no other build has) and ``leaf_ids`` are the ids of ``sharded``'s leaves, alive while kept.
    """

    raw: dict
    sharded: dict
    common: dict
    key: tuple | None = None
    token: tuple | None = None
    extra: list[tuple[torch.nn.Module, ShardedObject]] = dataclasses.field(default_factory=list)
    answer_none: list[torch.nn.Module] = dataclasses.field(default_factory=list)  # extra state None when built
    leaves: list[ShardedBase] = dataclasses.field(default_factory=list)  # held: ``leaf_ids`` stay theirs

    @functools.cached_property
    def leaf_ids(self) -> frozenset[int]:
        return frozenset(map(id, self.leaves))

    def refresh(self) -> bool:
        """Take the extra states anew (``get_extra_state`` at this save) into the leaves that hold
        them; False (nothing changed) where a module that answered None answers something else."""
        if any(module.get_extra_state() is not None for module in self.answer_none):
            return False
        for module, leaf in self.extra:
            leaf.data = module.get_extra_state()
        return True


def model_state(chunks: list, keys: list[str], metadata: dict, kept: ModelState | None) -> ModelState:
    """The chunks' sharded state at this save: ``kept`` refreshed when its key is this model's, else built."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    key = _key(chunks, metadata)
    if key is not None and kept is not None and kept.key == key and kept.refresh():
        return kept
    with _recorded_extra_states(chunks) as extra_states:
        raw = {name: chunk.sharded_state_dict(metadata=metadata) for name, chunk in zip(keys, chunks)}
    sharded, common = save_preprocess(_containers(raw), validate_access_integrity=False)
    state = ModelState(raw, sharded, common)
    if key is None or extra_states is None or common:
        return state
    leaves = list(sharding.sharded_leaves(sharded))
    extra = _extra_leaves(leaves, extra_states)
    if extra is None or not _views_of(leaves, chunks):
        return state
    return dataclasses.replace(state, key=key, token=("model state", next(_TOKENS)), extra=extra[0],
                               answer_none=extra[1], leaves=leaves)


def _key(chunks: list, metadata: dict) -> tuple | None:
    """The module tree (each module's object, class and the names of its children, parameters and
    buffers), every parameter and buffer (object and memory: ``file_plan.tensor_signatures``) and
    the content metadata; None where a tensor is not plain."""
    tree, tensors = [], []
    for chunk in chunks:
        for module in chunk.modules():
            params, buffers = module._parameters, module._buffers
            tree.append((id(module), type(module), tuple(module._modules), tuple(params), tuple(buffers)))
            tensors.extend(("", t) for t in params.values() if t is not None)
            tensors.extend(("", t) for t in buffers.values() if t is not None)
    memory = tensor_signatures(tensors)
    if memory is None:
        return None
    return (tuple(tree), tuple(id(t) for _, t in tensors), memory,
            tuple((k, v if isinstance(v, (bool, int, str)) else id(v)) for k, v in sorted(metadata.items())))


@contextlib.contextmanager
def _recorded_extra_states(chunks: list) -> Iterator[list | None]:
    """Within the block each module's ``get_extra_state`` records ``(module, value)`` of its calls.

    Only modules whose class defines extra state (the only ones torch's ``state_dict`` asks); the
    record is the instance's own attribute for the block, removed at its end. None (nothing
    recorded) where a module already has an instance attribute of that name.
    """
    modules = [m for chunk in chunks for m in chunk.modules()
               if type(m).get_extra_state is not torch.nn.Module.get_extra_state]
    if any("get_extra_state" in vars(m) for m in modules):
        yield None
        return
    records: list = []

    def recorder(module: torch.nn.Module):
        own = type(module).get_extra_state

        def get_extra_state() -> Any:
            value = own(module)
            records.append((module, value))
            return value
        return get_extra_state

    for module in modules:
        object.__setattr__(module, "get_extra_state", recorder(module))
    try:
        yield records
    finally:
        for module in modules:
            vars(module).pop("get_extra_state", None)


def _extra_leaves(leaves: list[ShardedBase], records: list) -> tuple[list, list] | None:
    """Each recorded extra state's leaf (the ShardedObject holding that very value), and the modules
    whose extra state is None (megatron-core's own linear layers), or None where a ShardedObject is
    neither: a value the build made of something else, which the next save could not take anew.

    A None has no identity to follow; its leaves stay None for as long as these modules answer None
    (``ModelState.refresh`` asks them again). A value found in no leaf did not reach the checkpoint
    (megatron-core drops the output layer's, after checking it is empty).
    """
    objects = [leaf for leaf in leaves if isinstance(leaf, ShardedObject)]
    by_value = {}
    for leaf in objects:
        if leaf.data is not None:
            by_value.setdefault(id(leaf.data), []).append(leaf)
    found, answer_none = [], []
    for module, value in records:
        if value is None:
            answer_none.append(module)
            continue
        holders = by_value.pop(id(value), [])
        if len(holders) > 1:
            return None
        found.extend((module, leaf) for leaf in holders)
    if by_value or any(leaf.data is None and not leaf.key.endswith("_extra_state") for leaf in objects):
        return None
    if any(leaf.data is None for leaf in objects) and not answer_none:
        return None
    return found, answer_none


def _views_of(leaves: list[ShardedBase], chunks: list) -> bool:
    """Whether every ShardedTensor's data is memory of the chunks' parameters or buffers (no copy)."""
    with torch._C.DisableTorchFunction():
        storages = {t.untyped_storage().data_ptr() for chunk in chunks
                    for t in itertools.chain(chunk.parameters(), chunk.buffers()) if t.numel()}
        for leaf in leaves:
            if isinstance(leaf, ShardedTensor):
                data = leaf.data
                if not isinstance(data, torch.Tensor) or (data.numel() and
                                                          data.untyped_storage().data_ptr() not in storages):
                    return False
    return True


def _containers(value: Any) -> Any:
    """``value`` with its dicts and lists copied, its leaves shared: ``save_preprocess`` replaces
    factories in place, and ``raw`` stays as megatron-core built it."""
    if isinstance(value, dict):
        return {k: _containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_containers(v) for v in value]
    return value
