"""The distributed optimizer's state in model space, as the lazy snapshot sees it, and two load-time repairs.

Saving: each data-parallel rank of a ``DistributedOptimizer`` holds, for every parameter that
reaches into its slice of the grad buffers, a contiguous slice of that parameter's fp32 main copy
and Adam moments. ``model_space_state_dict`` describes these as ``sharding.FlatShardedTensor``
leaves ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``: the parameter's global
box (key, offset, shape, from the model's sharded state dict) plus the slice of its flattened box
(``flattened_range``). The data are the optimizer's own tensors, so the snapshot copies straight
from the optimizer's memory: no gather, no staging copy. Unlike the bucket-space
``dp_reshardable`` format, nothing depends on how parameters are packed into buckets, so a
checkpoint loads into another TP/PP/DP layout; the remaining, non-parameter state (param
groups, grad scaler) is the same on every rank. This is megatron-core's
``fully_sharded_model_space`` format, which its 0.16.1 release can neither build (its
``ShardedTensor`` rejects ``flattened_range``) nor read back with torch Adam (see
``load_model_space_state_dict``).

Parameters whose model state is a ``ShardedTensorFactory`` (the gated MLP's ``linear_fc1`` split
into its two halves, Mamba's and gated delta net's input projections split into their parts)
are saved as the boxes the factory builds: ``model_boxes`` builds the factory on the live
parameter, and where every piece is a contiguous run of the parameter's memory (a split along
dimension 0), this rank's flat slice is cut at the pieces' boundaries, one leaf per piece it
reaches. A factory whose pieces are copies or strided views (the legacy ``GroupedMLP``'s
transposed expert weights) cannot be described per slice without a gather and is refused by
name.

Loading, on the torch-Adam path (no Transformer Engine or Apex, as on CPUs):

* a fresh optimizer has no Adam state yet, and ``DistributedOptimizer.state_dict()`` fails
  without it, so ``ensure_state`` allocates it (values are overwritten by the load);
* after the load every param shares one ``step`` tensor holding the pre-load value, so
  ``restore_adam_steps`` gives each param its own ``step`` equal to the checkpointed count kept
  in ``param_groups[i]['step']``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron_ext.megatron import sharding

MODEL_SPACE = "fully_sharded_model_space"
BEFORE_FIRST_STEP = "saved_before_first_step"


def _distributed(optimizer: Any) -> Iterator[Any]:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt


def _is_distributed(opt: Any) -> bool:
    return hasattr(opt, "gbuf_ranges") and hasattr(opt, "_get_main_param_and_optimizer_states")


def model_space_state_dict(optimizer: Any, model_sharded: dict, is_loading: bool = False) -> Any:
    """The optimizer's sharded state dict, in model space for distributed optimizers.

    ``model_sharded`` is the model's sharded state dict (before any preprocessing), whose
    ShardedTensors hold the parameters themselves. Other optimizers already describe their
    state per parameter; their own ``sharded_state_dict`` is used, which for a load template
    (``is_loading``) first allocates the Adam state a fresh optimizer does not have yet.
    """
    optimizers = list(_distributed(optimizer))
    if not all(_is_distributed(opt) for opt in optimizers):
        return optimizer.sharded_state_dict(model_sharded, is_loading=is_loading)
    by_param = model_boxes(model_sharded)
    states = [_model_space(opt, by_param) for opt in optimizers]
    return states[0] if len(states) == 1 else dict(enumerate(states))


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
        start = None if data is None else data.untyped_storage().data_ptr() + data.storage_offset() * data.element_size()
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


def _param_slices(opt: Any) -> Iterator[tuple[Any, slice]]:
    """Each parameter reaching into this data-parallel rank's grad-buffer slice, with its part of it."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    yield model_param, slice(ranges["param"].start, ranges["param"].end)


def _has_stepped(opt: Any) -> bool:
    """Whether the inner optimizer has state yet (not before its first step: fp16's skipped first steps)."""
    return any(len(s) for s in opt.optimizer.state.values())


def _param_tensors(opt: Any, model_param: Any) -> dict[str, torch.Tensor]:
    """The optimizer's own fp32 main param and Adam moments of this rank's slice of ``model_param``."""
    if not _has_stepped(opt):  # only the main param exists (reading the state would create empty entries)
        group_index, group_order = opt.model_param_group_index_map[model_param]
        return {"fp32_param": opt.optimizer.param_groups[group_index]["params"][group_order]}
    tensors = opt._get_main_param_and_optimizer_states(model_param)
    tensors["fp32_param"] = tensors.pop("param")
    tensors.pop("step", None)  # kept in param_groups (one count for all params)
    return tensors


def _common_state(opt: Any) -> dict:
    """Param groups and grad scaler: the same on every rank.

    Before the first step megatron-core's ``state_dict()`` fails on torch's Adam (it reads the
    step count from the per-parameter state); the groups then say step 0, as its loader expects.
    """
    if _has_stepped(opt):
        return opt.state_dict()
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": 0}
              for group in opt.optimizer.state_dict()["param_groups"]]
    state: dict = {"optimizer": {"param_groups": groups}}
    if opt.grad_scaler:
        state["grad_scaler"] = opt.grad_scaler.state_dict()
    return state


def _model_space(opt: Any, by_param: dict) -> dict:
    state = _common_state(opt)
    param_state = {}
    for model_param, flat in _param_slices(opt):
        boxes = by_param.get(model_param)
        if boxes is None or any(len(sharding.replica_tuple(box.shard.replica_id)) != 3 for box in boxes):
            raise ValueError(f"parameter of shape {tuple(model_param.shape)} has no (PP, TP, DP) ShardedTensor "
                             "in the model's sharded state dict")
        param_state[len(param_state)] = {
            name: _slice_leaves(opt, boxes, name, tensor, flat) for name, tensor in _param_tensors(opt, model_param).items()}
    state["param_state"] = param_state
    state["param_state_sharding_type"] = MODEL_SPACE
    if not _has_stepped(opt):
        state[BEFORE_FIRST_STEP] = True  # main params only: the load template must not ask for moments
    return state


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


def _joined(loaded: Any) -> torch.Tensor:
    """A loaded slice: one tensor, or the pieces ``_slice_leaves`` cut it into, joined in memory order."""
    if isinstance(loaded, dict):
        return torch.cat([loaded[k].reshape(-1) for k in sorted(loaded)])
    return loaded


def saved_before_first_step(saved_common: Any) -> bool:
    """Whether a checkpoint's optimizer (its common part) was saved before the first step."""
    if not isinstance(saved_common, dict):
        return False
    states = [saved_common] if "param_state_sharding_type" in saved_common else list(saved_common.values())
    return any(isinstance(s, dict) and s.get(BEFORE_FIRST_STEP) for s in states)


def load_model_space_state_dict(optimizer: Any, state: Any) -> None:
    """Inverse of ``model_space_state_dict``, its ShardedTensors replaced by the loaded tensors.

    megatron-core's own reader of this format (``load_parameter_state_from_fs_model_space``)
    fails on torch Adam, whose per-param state also holds ``step``; the values are copied into
    the optimizer's tensors here instead, and ``step`` comes from the param groups.
    """
    optimizers = list(_distributed(optimizer))
    if not all(_is_distributed(opt) for opt in optimizers):
        optimizer.load_state_dict(state)
        restore_adam_steps(optimizer)
        return
    states = [state] if len(optimizers) == 1 else [state[i] for i in sorted(state)]
    for opt, opt_state in zip(optimizers, states):
        param_state = opt_state.get("param_state", {})
        opt.load_state_dict({k: v for k, v in opt_state.items()
                             if k not in ("param_state", "param_state_sharding_type", BEFORE_FIRST_STEP)})
        scaled = getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        stepped = not opt_state.get(BEFORE_FIRST_STEP)
        for index, (model_param, _) in enumerate(_param_slices(opt)):
            loaded = {k: _joined(v) for k, v in param_state[index].items()}
            if scaled:  # the optimizer keeps scaled copies: megatron-core's own setter rescales
                opt._set_main_param_and_optimizer_states(
                    model_param, {"param" if k == "fp32_param" else k: v for k, v in loaded.items()})
                continue
            with torch.no_grad():  # in fp32 the main params are the model's own (leaf) params
                for name, tensor in _param_tensors(opt, model_param).items():
                    if name in loaded:
                        tensor.copy_(loaded[name])
        if not stepped:  # saved before the first step: so is this optimizer now (its next step starts the moments)
            opt.optimizer.state.clear()
    restore_adam_steps(optimizer)


def ensure_state(optimizer: Any) -> None:
    for opt in _distributed(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and len(inner.state) == 0 and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


def allocate_state(optimizer: Any) -> None:
    """Like ``ensure_state``, for a load that overwrites every value: torch Adam's state allocated, not computed.

    ``ensure_state`` runs a whole zero-gradient Adam step (gradients allocated, moments zeroed,
    then the update's arithmetic over every parameter), which costs more than reading the moments
    on CPUs. A datastates load reads every moment straight into these tensors (``step`` comes from
    the param groups), so uninitialised memory is enough. Other optimizers (fused, capturable,
    amsgrad, not torch's Adam/AdamW) take ``ensure_state``.
    """
    for opt in _distributed(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) or not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            continue
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or any(
                g.get("fused") or g.get("capturable") or g.get("amsgrad") for g in inner.param_groups):
            opt._init_optimizer_states_with_dummy_values()
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if param.numel() == 0:
                    continue
                inner.state[param] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                      "exp_avg": torch.empty_like(param, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.empty_like(param, memory_format=torch.preserve_format)}


def restore_adam_steps(optimizer: Any) -> None:
    for opt in _distributed(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def check_param_groups(optimizer: Any, saved: Any) -> None:
    """Every param group of this rank must be among the saved ones (rank 0's, in ``common``).

    The non-parameter state is saved once, by global rank 0, and loaded on every rank, whatever
    its pipeline stage and layout; megatron-core matches groups by their identity keys
    (``wd_mult``, ``lr_mult``, ...), so a stage with a kind of group rank 0's stage lacks cannot load.
    """
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    from megatron_ext.engine import CheckpointError

    optimizers = list(_distributed(optimizer))
    saved_states = [saved] if len(optimizers) == 1 else [saved[i] for i in sorted(saved)]
    for opt, state in zip(optimizers, saved_states):
        if not _is_distributed(opt):
            continue

        def identity(group: dict) -> tuple:
            return tuple(group.get(k) for k in param_group_identifier_keys)

        have = {identity(g) for g in state["optimizer"]["param_groups"]}
        need = {identity(g) for g in opt.optimizer.param_groups}
        if not need <= have:
            raise CheckpointError(f"optimizer param groups {sorted(need - have)} (by {param_group_identifier_keys}) "
                                  "are not in the checkpoint's, which global rank 0 saved")


def load_fully_reshardable_state_dict(optimizer: Any, state: Any) -> None:
    """megatron-core's ``fully_reshardable`` optimizer state (whole parameter boxes) into this rank's slices.

    What ``DistributedOptimizer.load_parameter_state_from_fully_reshardable`` does, which fails on
    torch Adam (its per-parameter state also holds ``step``, as on CPUs without Transformer Engine
    or Apex): ``param_state[i]`` belongs to the ``i``-th parameter of the grad buffers'
    ``param_index_map`` order, all ranks' parameters counted; each rank copies its slice.
    """
    optimizers = list(_distributed(optimizer))
    states = [state] if len(optimizers) == 1 else [state[i] for i in sorted(state)]
    for opt, opt_state in zip(optimizers, states):
        if not _is_distributed(opt):
            opt.load_state_dict(opt_state)
            continue
        param_state = opt_state["param_state"]
        opt.load_state_dict({k: v for k, v in opt_state.items() if k not in ("param_state", "param_state_sharding_type")})
        scaled = getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        local = dict(_param_slices(opt))
        index = 0
        for buffer in opt.buffers:
            for model_param in buffer.param_index_map:
                flat = local.get(model_param)
                if flat is not None:
                    sliced = {name: saved.reshape(-1)[flat] for name, saved in param_state[index].items()}
                    if scaled:  # the optimizer keeps scaled copies: megatron-core's own setter rescales
                        opt._set_main_param_and_optimizer_states(model_param, sliced)
                    else:
                        for name, tensor in _param_tensors(opt, model_param).items():
                            tensor.copy_(sliced["param" if name == "fp32_param" else name])
                index += 1
    restore_adam_steps(optimizer)
