"""The distributed optimizer's state in model space, as the lazy snapshot sees it (the save side).

Saving: each data-parallel rank of a ``DistributedOptimizer`` holds, for every parameter that
reaches into its slice of the grad buffers, a contiguous slice of that parameter's main copy
and Adam moments. ``model_space_state_dict`` describes these as ``sharding.FlatShardedTensor``
leaves ``optimizer.state.<name>.<model key>``: the parameter's global box (key, offset, shape,
from the model's sharded state dict) plus the slice of its flattened box (``flattened_range``).
The data are the optimizer's own tensors, so the snapshot copies straight from the optimizer's
memory: no gather, no staging copy. Unlike the bucket-space ``dp_reshardable`` format, nothing
depends on how parameters are packed into buckets, so a checkpoint loads into another TP/PP/DP
layout; the remaining, non-parameter state (param groups, grad scaler) is the same on every
rank. This is megatron-core's ``fully_sharded_model_space`` format, which its 0.19.0 release can
neither build (its ``ShardedTensor`` rejects ``flattened_range``) nor read back with torch Adam
(see ``load_model_space_state_dict``).

Reading the stored tensors directly is what makes the save zero-copy: megatron-core's own
``_get_main_param_and_optimizer_states`` (through FusedAdam's ``get_unscaled_state``) and
``DistributedOptimizer.state_dict`` (through FusedAdam's ``state_dict``) each build fp32 copies of
every non-fp32 moment, on the GPU, at every save. The common state here is built from torch's
``Optimizer.state_dict`` of the inner optimizer instead, which references the state (no copy).

Parameters whose model state is a ``ShardedTensorFactory`` (the gated MLP's ``linear_fc1`` split
into its two halves, Mamba's and gated delta net's input projections split into their parts)
are saved as the boxes the factory builds: ``model_boxes`` builds the factory on the live
parameter, and where every piece is a contiguous run of the parameter's memory (a split along
dimension 0), this rank's flat slice is cut at the pieces' boundaries, one leaf per piece it
reaches. A factory whose pieces are copies or strided views (the legacy ``GroupedMLP``'s
transposed expert weights) cannot be described per slice without a gather and is refused by
name.

Which optimizer this is and the stored forms it keeps are ``optimizer_forms.py``; the load of
this state and megatron-core's loads' repairs are ``optimizer_load.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from typing import Any, Callable, Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from megatron_ext.engine.errors import CheckpointError
from megatron_ext.engine.save.flow.file_plan import tensor_signatures
from megatron_ext.megatron import sharding
from megatron_ext.megatron.optimizer_forms import (
    BEFORE_FIRST_STEP,
    MODEL_SPACE,
    SCALE_SUFFIX,
    STORED_FORM,
    FP8_REFUSED,
    distributed_optimizers,
    has_stepped,
    holds_main_params,
    hybrid_optimizer,
    is_distributed,
    param_slices,
    refuse_fp8,
    saved_states,
    stored_form,
    sub_optimizer_states,
)

#: Read by ``convert.py`` from here (the stored forms live in ``optimizer_forms``).
__all__ = ["Box", "KeptParamState", "kept_leaves", "model_boxes", "model_space_state_dict", "param_state_key",
           "param_tensors", "save_preprocessed", "stored_tensors", "with_class_names", "with_live_classes"]


def model_space_state_dict(optimizer: Any, model_sharded: dict, is_loading: bool = False,
                           kept: dict | None = None, model_token: tuple | None = None) -> Any:
    """The optimizer's sharded state dict, in model space for distributed optimizers.

    ``model_sharded`` is the model's sharded state dict (before any preprocessing), whose
    ShardedTensors hold the parameters themselves. Other optimizers already describe their
    state per parameter; their own ``sharded_state_dict`` is used, which for a load template
    (``is_loading``) first allocates the state a fresh optimizer does not have yet (its
    ``init_state_fn``: Adam's two moments, Lion's one). Each such optimizer's common state records
    its stored form (``STORED_FORM``: its class and moment set), which the load compares with the
    run's before anything is read (``optimizer_forms.check_stored_form``).

    ``kept`` (a dict the caller keeps between saves): each distributed optimizer's per-parameter
    leaves are kept there and reused while ``param_state_key`` is unchanged; the common state
    (param groups, grad scaler) is read anew at every call. ``model_token``: what stands for
    ``model_sharded``'s exact leaves and memory when the caller keeps it (``model_state.ModelState``);
    without one they are read (``model_key``).
    """
    optimizers = list(distributed_optimizers(optimizer))
    if not all(is_distributed(opt) for opt in optimizers):
        state = optimizer.sharded_state_dict(model_sharded, is_loading=is_loading)
        for opt, part in zip(optimizers, saved_states(optimizers, state)):
            if isinstance(part, dict) and not is_distributed(opt):
                part[STORED_FORM] = stored_form(opt)
        return state
    by_param = functools.cache(lambda: model_boxes(model_sharded))  # only when some leaves are made anew
    model = (model_token or model_key(model_sharded)) if kept is not None else None
    states = [_model_space(opt, by_param, kept, model) for opt in optimizers]
    return states[0] if len(states) == 1 else dict(enumerate(states))


def model_key(model_sharded: dict) -> tuple | None:
    """What ``model_boxes`` reads of the model's sharded state dict, exactly: every leaf's fields and
    data memory (``sharding.leaf_signature``) and its data object (boxes are found by the parameter
    object); None with a factory (its pieces are built anew at every call)."""
    leaves = list(sharding.sharded_leaves(model_sharded))
    signature = sharding.leaf_signature(leaves)
    return None if signature is None else (signature, tuple(id(leaf.data) for leaf in leaves))


@dataclasses.dataclass(frozen=True)
class Box:
    """One model-space box of a parameter: its ShardedTensor and where it starts in the flat parameter."""

    shard: ShardedTensor
    offset: int  # first element of the box in the parameter's flat (row-major) memory

    @property
    def numel(self) -> int:
        return math.prod(self.shard.local_shape)


def model_boxes(model_sharded: dict) -> dict[Any, list[Box]]:
    """Each parameter of the model's sharded state dict -> its boxes in model space, in memory order.

    A ShardedTensor is one box over the whole parameter; a ShardedTensorFactory is built on the
    live parameter and each piece must be a contiguous run of its memory (see the module
    docstring), else a ValueError names the factory.
    """
    boxes: dict[Any, list[Box]] = {}
    for leaf in sharding.sharded_leaves(model_sharded):
        if isinstance(leaf, ShardedTensor):
            boxes[leaf.data] = [Box(leaf, 0)]
        elif isinstance(leaf, ShardedTensorFactory) and isinstance(leaf.data, torch.Tensor):
            boxes[leaf.data] = _factory_boxes(leaf)
    return boxes


def _factory_boxes(factory: ShardedTensorFactory) -> list[Box]:
    param = factory.data
    pieces = list(sharding.sharded_leaves(factory.build_fn(factory.key, param, factory.replica_id, None)))
    base = param.untyped_storage().data_ptr() + param.storage_offset() * param.element_size()
    boxes = []
    for piece in pieces:
        data = piece.data if isinstance(piece, ShardedTensor) else None
        start = None if data is None else \
            data.untyped_storage().data_ptr() + data.storage_offset() * data.element_size()
        if (data is None or not data.is_contiguous() or data.dtype != param.dtype or start is None
                or data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
            raise ValueError(f"the sharded state of parameter {factory.key!r} {tuple(param.shape)} comes from a "
                             "ShardedTensorFactory whose pieces are not contiguous parts of the parameter; its "
                             "optimizer state cannot be saved per data-parallel slice without a gather "
                             "(docs/MEGATRON.md, factories)")
        boxes.append(Box(piece, (start - base) // param.element_size()))
    boxes.sort(key=lambda box: box.offset)
    ends = [box.offset + box.numel for box in boxes]
    if boxes[0].offset != 0 or ends[-1] != param.numel() or any(e != b.offset for e, b in zip(ends, boxes[1:])):
        raise ValueError(f"the pieces ShardedTensorFactory {factory.key!r} builds do not tile its parameter "
                         f"{tuple(param.shape)} exactly")
    return boxes


def _stored(opt: Any, param: Any, key: str, tensor: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One state tensor of the inner optimizer as saved: ``({shard name: tensor}, {shard name: its scale})``."""
    base = "main_param" if key in ("master_param", "param") else key
    declared = (getattr(opt.optimizer, "name_to_dtype_map", None) or {}).get(key)
    if declared == torch.uint8 or hasattr(tensor, "_scale_inv"):  # a TE Float8Tensor (its dtype says float32)
        raise CheckpointError(FP8_REFUSED.format(key))
    if type(tensor) is not torch.Tensor:
        raise CheckpointError(f"the optimizer keeps {key} as {type(tensor).__name__}, which megatron_ext does not save")
    if tensor.dtype == torch.float32:
        return {"fp32_param" if base == "main_param" else base: tensor}, {}
    if tensor.dtype == torch.int16 and base == "main_param":
        return {"main_param_remainders": tensor}, {}
    if tensor.dtype == torch.bfloat16 and base != "main_param":
        return {f"{base}_bf16": tensor}, {}
    if tensor.dtype == torch.float16:  # FusedAdam keeps fp16 state divided by a per-tensor scale
        name = f"{base}_fp16"
        return {name: tensor}, {name: opt.optimizer._scales[param][key]}
    raise CheckpointError(f"the optimizer keeps {key} as {tensor.dtype}, a stored form megatron_ext does not save")


def stored_tensors(opt: Any, model_param: Any, sub_states: dict | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The optimizer's own stored tensors of this rank's slice of ``model_param`` (no copy), and their scales.

    Plain optimizers: megatron-core's fp32 main param and the inner optimizer's moments. With
    ``--use-precision-aware-optimizer`` the inner FusedAdam's state as it stores it (``_stored``);
    before its first step it holds nothing (the main params are the model's own until then). With
    a ``HybridDeviceOptimizer`` the master its sub-optimizer steps and that sub-optimizer's moments
    (``sub_states``: ``sub_optimizer_states``, computed here when not given).
    """
    group_index, group_order = opt.model_param_group_index_map[model_param]
    param = opt.optimizer.param_groups[group_index]["params"][group_order]
    slices: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    hdo = hybrid_optimizer(opt)
    if hdo is not None:
        master = hdo.param_to_inner_param[param]
        slices["fp32_param"] = master
        state = (sub_optimizer_states(hdo) if sub_states is None else sub_states).get(master, {})
    elif holds_main_params(opt):
        if not has_stepped(opt):
            return slices, scales
        state = opt.optimizer.state[param]
    else:
        slices["fp32_param"] = param
        if not has_stepped(opt):  # only the main param exists (reading the state would create empty entries)
            return slices, scales
        state = opt.optimizer.state[param]
    for key, tensor in state.items():
        if key not in ("step", "master_param") or (key == "master_param" and hdo is None):  # step: in param_groups
            more, more_scales = _stored(opt, param, key, tensor)
            slices.update(more)
            scales.update(more_scales)
    return slices, scales


def param_tensors(opt: Any, model_param: Any, sub_states: dict | None = None) -> dict[str, torch.Tensor]:
    """The optimizer's own stored tensors of this rank's slice of ``model_param``, by shard name (no copy)."""
    return stored_tensors(opt, model_param, sub_states)[0]


@contextlib.contextmanager
def _state_dict_without_copies(opt: Any) -> Iterator[None]:
    """Within the block the inner optimizer's ``state_dict`` is torch's, which references the state.

    TE's FusedAdam overrides it to return fp32 copies of every non-fp32 state (``get_unscaled_state``);
    megatron-core's ``DistributedOptimizer.state_dict`` calls it and then drops the state, keeping the
    param groups. torch's own gives the same param groups without the copies.
    """
    inner = opt.optimizer
    if not hasattr(inner, "get_unscaled_state") or not isinstance(inner, torch.optim.Optimizer):
        yield
        return
    inner.state_dict = functools.partial(torch.optim.Optimizer.state_dict, inner)
    try:
        yield
    finally:
        del inner.state_dict


def with_class_names(state: dict) -> dict:
    """``state`` with the classes its param groups hold (the HDO's sub-optimizer classes) as their names."""
    optim = state.get("optimizer")
    if not isinstance(optim, dict) or "param_groups" not in optim:
        return state
    groups = [{k: f"{v.__module__}.{v.__qualname__}" if isinstance(v, type) else v for k, v in group.items()}
              for group in optim["param_groups"]]
    return {**state, "optimizer": {**optim, "param_groups": groups}}


def with_live_classes(opt: Any, state: dict) -> dict:
    """Inverse of ``with_class_names``: the run's own classes (its optimizer's defaults) in the loaded groups.

    The names in the checkpoint are never resolved; a class-valued setting is the run's own.
    """
    classes = {k: v for k, v in getattr(getattr(opt, "optimizer", None), "defaults", {}).items()
               if isinstance(v, type)}
    optim = state.get("optimizer")
    if not classes or not isinstance(optim, dict) or "param_groups" not in optim:
        return state
    groups = [{**group, **{k: classes[k] for k in classes if k in group}} for group in optim["param_groups"]]
    return {**state, "optimizer": {**optim, "param_groups": groups}}


def _common_state(opt: Any) -> dict:
    """Param groups and grad scaler: the same on every rank.

    Before the first step megatron-core's ``state_dict()`` fails on torch's Adam (it reads the
    step count from the per-parameter state); the groups then say step 0, as its loader expects.
    """
    if has_stepped(opt):
        with _state_dict_without_copies(opt):
            return with_class_names(opt.state_dict())
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": 0}
              for group in opt.optimizer.state_dict()["param_groups"]]
    state: dict = {"optimizer": {"param_groups": groups}}
    if opt.grad_scaler:
        state["grad_scaler"] = opt.grad_scaler.state_dict()
    return with_class_names(state)


def param_state_key(opt: Any, model: tuple | None) -> tuple | None:
    """What ``_param_state``'s leaves are made of, exactly: the model's leaves (``model_key``, which
    decides each parameter's boxes), each parameter slice of this rank, the inner optimizer's
    tensors of it (which states, their objects, memory and layout: ``file_plan.tensor_signatures``)
    and the instance id. Every object named by its id here is alive while the key is kept (the
    model's parameters, the optimizer's tensors, which the kept leaves view). None where the
    leaves are not kept: a model key of None, a hybrid (CPU offloading) or precision-aware
    optimizer, whose stored forms and scales are read through structures of their own.
    """
    if model is None or hybrid_optimizer(opt) is not None or holds_main_params(opt):
        return None
    inner = opt.optimizer
    described, tensors = [], []
    for model_param, flat in param_slices(opt):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        param = inner.param_groups[group_index]["params"][group_order]
        state = inner.state.get(param, {})
        described.append((id(model_param), flat.start, flat.stop, group_index, group_order, id(param),
                          tuple((k, type(v), id(v)) for k, v in state.items())))
        tensors.append(("", param))
        tensors.extend(("", v) for v in state.values() if isinstance(v, torch.Tensor))
    memory = tensor_signatures(tensors)
    if memory is None:
        return None
    return model, opt.distributed_optimizer_instance_id, tuple(described), memory


def _model_space(opt: Any, by_param: Callable[[], dict], kept: dict | None = None, model: tuple | None = None) -> dict:
    form = stored_form(opt)
    refuse_fp8(form)
    state = _common_state(opt)
    key = param_state_key(opt, model) if kept is not None else None
    was = kept.get(id(opt)) if kept is not None else None
    if key is not None and was is not None and was.opt is opt and was.key == key:
        param_state = was.param_state
    else:
        param_state = _param_state(opt, by_param())
        if kept is not None:
            kept.pop(id(opt), None)
            if key is not None:  # the optimizer held: its id stays its own
                kept[id(opt)] = KeptParamState(opt, key, param_state)
    state["param_state"] = param_state
    state["param_state_sharding_type"] = MODEL_SPACE
    state[STORED_FORM] = form
    if not has_stepped(opt):
        state[BEFORE_FIRST_STEP] = True  # main params only: the load template must not ask for moments
    return state


@dataclasses.dataclass(eq=False)
class KeptParamState:
    """One distributed optimizer's model-space leaves (``_param_state``), kept for the next save while
    ``param_state_key`` is unchanged; the caller's ``kept`` dict holds it by the optimizer's id."""

    opt: Any  # held: the id it is kept under stays its own
    key: tuple  # ``param_state_key``
    param_state: dict

    @functools.cached_property
    def leaf_ids(self) -> frozenset[int]:
        return frozenset(map(id, sharding.sharded_leaves(self.param_state)))

    @functools.cached_property
    def preprocessed(self) -> tuple[dict | None, int]:
        """``save_preprocess`` of ``param_state`` (its sharded part; None where that leaves a common
        value), done once, and a token no other kept state has."""
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

        sharded, common = save_preprocess({"param_state": self.param_state}, validate_access_integrity=False)
        return (None if common else sharded.get("param_state")), next(_TOKENS)


def save_preprocessed(state: Any, kept: dict | None) -> tuple[dict, dict, tuple | None]:
    """megatron-core's ``save_preprocess({"optimizer": state})`` (the sharded part and the common one),
    each ``param_state`` that ``kept`` holds preprocessed once and taken as it was then, and what
    stands for the whole sharded part when it is only such kept parts (their tokens), else None.

    A kept ``param_state`` is the same leaves again, and preprocessing (factories, non-persistent
    values, the sharded/common split) treats each subtree on its own, so its result is the same; the
    rest of ``state`` (param groups, grad scaler: read anew at every save) is preprocessed now.
    """
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    states = {id(entry.param_state): entry for entry in (kept or {}).values()}
    reused: list[tuple[tuple, dict, int]] = []

    def without_kept(part: dict, path: tuple) -> dict:
        entry = states.get(id(part.get("param_state")))
        if entry is None or entry.param_state is not part["param_state"]:
            return part
        preprocessed, token = entry.preprocessed
        if preprocessed is None:
            return part
        reused.append((path, preprocessed, token))
        return {k: v for k, v in part.items() if k != "param_state"}

    if not isinstance(state, dict):
        rest = state
    elif "param_state" in state:
        rest = without_kept(state, ())
    else:  # chained optimizers: {number: state}
        rest = {k: without_kept(v, (k,)) if isinstance(v, dict) and "param_state" in v else v for k, v in state.items()}
    sharded, common = save_preprocess({"optimizer": rest}, validate_access_integrity=False)
    whole = None if any(True for _ in sharding.sharded_leaves(sharded)) else tuple(token for *_, token in reused)
    for path, part, _ in reused:
        node = sharded.setdefault("optimizer", {})
        for k in path:
            node = node.setdefault(k, {})
        node["param_state"] = part
    return sharded, common, whole


_TOKENS = itertools.count(1)  # a kept param_state's token (``KeptParamState.preprocessed``): unique in a process


def kept_leaves(kept: dict) -> frozenset[int]:
    """The ids of the leaves ``kept`` holds (made by ``_param_state``, unchanged since, and alive while kept)."""
    return frozenset().union(*(entry.leaf_ids for entry in kept.values()))


def _param_state(opt: Any, by_param: dict) -> dict:
    """Each parameter slice's leaves (``_slice_leaves``) and scales, by its number."""
    param_state = {}
    hdo = hybrid_optimizer(opt)
    sub_states = sub_optimizer_states(hdo) if hdo is not None else None
    for model_param, flat in param_slices(opt):
        boxes = by_param.get(model_param)
        if boxes is None or any(len(sharding.replica_tuple(box.shard.replica_id)) != 3 for box in boxes):
            raise ValueError(f"parameter of shape {tuple(model_param.shape)} has no (PP, TP, DP) ShardedTensor "
                             "in the model's sharded state dict")
        slices, scales = stored_tensors(opt, model_param, sub_states)
        entry: dict[str, Any] = {name: _slice_leaves(opt, boxes, name, tensor, flat) for name, tensor in slices.items()}
        first = boxes[0].shard
        replica_id = (*sharding.replica_tuple(first.replica_id)[:2], opt.distributed_optimizer_instance_id)
        for name, scale in scales.items():  # one value per slice: an object of this rank's slice
            entry[name + SCALE_SUFFIX] = ShardedObject(
                f"optimizer.state.{name}{SCALE_SUFFIX}.{first.key}#{flat.start}:{flat.stop}", scale,
                tuple(first.global_shape), tuple(first.global_offset), replica_id)
        param_state[len(param_state)] = entry
    return param_state


def _slice_leaves(opt: Any, boxes: list[Box], name: str, tensor: torch.Tensor, flat: slice) -> Any:
    """This rank's slice ``flat`` of a parameter's state ``name`` as model-space leaves (views of ``tensor``).

    One leaf for a parameter of one box (the layout of every checkpoint so far); for a factory's
    pieces, ``{piece number: leaf}`` for each piece the slice reaches, in memory order.
    """
    leaves = {}
    for number, box in enumerate(boxes):
        lo, hi = max(flat.start, box.offset), min(flat.stop, box.offset + box.numel)
        if lo >= hi:
            continue
        replica_id = (*sharding.replica_tuple(box.shard.replica_id)[:2], opt.distributed_optimizer_instance_id)
        leaves[number] = sharding.flat_shard(box.shard, f"optimizer.state.{name}.{box.shard.key}",
                                             tensor[lo - flat.start:hi - flat.start],
                                             slice(lo - box.offset, hi - box.offset), replica_id)
    return leaves[0] if len(boxes) == 1 else leaves

