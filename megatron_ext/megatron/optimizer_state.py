"""The distributed optimizer's state in model space, as the lazy snapshot sees it, and two load-time repairs.

Saving: each data-parallel rank of a ``DistributedOptimizer`` holds, for every parameter that
reaches into its slice of the grad buffers, a contiguous slice of that parameter's main copy
and Adam moments. ``model_space_state_dict`` describes these as ``sharding.FlatShardedTensor``
leaves ``optimizer.state.<name>.<model key>``: the parameter's global box (key, offset, shape,
from the model's sharded state dict) plus the slice of its flattened box (``flattened_range``).
The data are the optimizer's own tensors, so the snapshot copies straight from the optimizer's
memory: no gather, no staging copy. Unlike the bucket-space ``dp_reshardable`` format, nothing
depends on how parameters are packed into buckets, so a checkpoint loads into another TP/PP/DP
layout; the remaining, non-parameter state (param groups, grad scaler) is the same on every
rank. This is megatron-core's ``fully_sharded_model_space`` format, which its 0.16.1 release can
neither build (its ``ShardedTensor`` rejects ``flattened_range``) nor read back with torch Adam
(see ``load_model_space_state_dict``).

Stored forms. What is saved is the optimizer's *stored* form, never a converted copy:

* plain (torch Adam, or TE's/Apex's FusedAdam without ``--use-precision-aware-optimizer``):
  megatron-core's fp32 main params and fp32 moments, ``fp32_param``, ``exp_avg``, ``exp_avg_sq``;
* ``--use-precision-aware-optimizer`` (TE's FusedAdam keeps the main params and moments, see
  ``megatron_ext/testing/te_fused_adam.py`` for what it stores): each tensor as FusedAdam holds it,
  named by its kind so that no reader can take one kind for another: ``fp32_param``/``exp_avg``/
  ``exp_avg_sq`` when fp32, ``main_param_remainders`` (int16: the low 16 bits of the fp32 main
  params whose high 16 bits are the bf16 model params themselves, ``store_param_remainders``),
  ``exp_avg_bf16``/``exp_avg_sq_bf16`` (no scale), and ``main_param_fp16``/``exp_avg_fp16``/
  ``exp_avg_sq_fp16``, which FusedAdam keeps divided by a per-tensor scale (one fp32 value per
  parameter slice of this rank, ``FusedAdam._scales``), saved beside them as an object shard
  ``optimizer.state.<name>_scale.<model key>#<start>:<stop>``.

Reading the stored tensors directly is what makes the save zero-copy: megatron-core's own
``_get_main_param_and_optimizer_states`` (through FusedAdam's ``get_unscaled_state``) and
``DistributedOptimizer.state_dict`` (through FusedAdam's ``state_dict``) each build fp32 copies of
every non-fp32 moment, on the GPU, at every save. The common state here is built from torch's
``Optimizer.state_dict`` of the inner optimizer instead, which references the state (no copy).

What cannot be made exact is refused with a ``CheckpointError``: fp8 moments
(``--exp-avg-dtype fp8``: FusedAdam keeps TE ``Float8Tensor``s, whose data and scale-inverse this
module does not save; refused at start-up and at the first save), and loading a scaled form
(fp16) into another TP/PP/DP layout (a slice's scale does not describe the resharded slices; the
other forms are elementwise and reshard exactly). The stored form (``stored_form``) is recorded
in the common state (``datastates_stored_form``), and a load whose optimizer keeps another form
is refused naming both and the flags (``check_stored_form``); a checkpoint without the record
(saved before it existed) holds the plain form.

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

Loading a precision-aware form writes every stored tensor and scale back as it was saved
(``load_model_space_state_dict``), after megatron-core's ``load_state_dict`` has restored the
param groups (which re-creates FusedAdam's state tensors).

With ``--optimizer-cpu-offload`` the distributed optimizer's inner optimizer is megatron-core's
``HybridDeviceOptimizer`` (HDO): its parameters are the bf16 shards of the model's parameters,
and the fp32 masters and moments live in its sub-optimizers (a CPU one for the offloaded
fraction, a device one for the rest), which step them in place and copy the masters back over
the model's shards after every step. ``HDO.state`` is rebuilt from the sub-optimizers after each
step and is only a view of them: a load that sets it (megatron-core's
``_set_main_param_and_optimizer_states``) leaves the sub-optimizers' masters stale until
``_sync_hdo_state_to_sub_optimizers`` copies them, which megatron-core's own loaders call and so
does every load here (``_sync_hybrid``). The save reads the sub-optimizers' own tensors (the
masters they step and their moments), so it never depends on that view being current. All of
it is mutated inside ``HDO.step``, i.e. inside ``step_with_ready_grads``, where the lazy wait sits.
The HDO's param groups carry its sub-optimizer classes; the sidecar stores their names, and a
load puts the run's own classes back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from megatron_ext.engine import CheckpointError
from megatron_ext.megatron import sharding

MODEL_SPACE = "fully_sharded_model_space"
BEFORE_FIRST_STEP = "saved_before_first_step"
STORED_FORM = "datastates_stored_form"
#: Set by ``megatron-ext convert`` from megatron-core's ``fully_reshardable``: the model-space state
#: is held as whole parameter boxes, and each rank's flat slices are cut out of them at the load.
BOXES = "datastates_whole_boxes"
#: Keys of a distributed optimizer's common state that only this module reads.
_OWN_KEYS = ("param_state", "param_state_sharding_type", BEFORE_FIRST_STEP, STORED_FORM, BOXES)
OWN_KEYS = _OWN_KEYS

_KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}
REMAINDERS = "bf16 + int16 remainders"  # fp32 main params as the bf16 model params plus their low 16 bits
#: The stored form of a checkpoint saved before the form was recorded: the only one that was exact then.
PLAIN_FORM = {"main_params": "fp32", "exp_avg": "fp32", "exp_avg_sq": "fp32", "precision_aware_optimizer": False}
_COMPARED = ("main_params", "exp_avg", "exp_avg_sq")
SCALE_SUFFIX = "_scale"


def _distributed(optimizer: Any) -> Iterator[Any]:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt


def _is_distributed(opt: Any) -> bool:
    return hasattr(opt, "gbuf_ranges") and hasattr(opt, "_get_main_param_and_optimizer_states")


def _hybrid(opt: Any) -> Any:
    """The ``HybridDeviceOptimizer`` a distributed optimizer steps with (``--optimizer-cpu-offload``), else None."""
    try:
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    except ImportError:  # a megatron-core without CPU offloading
        return None
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, HybridDeviceOptimizer) else None


def _sub_states(hdo: Any) -> dict:
    """Each HDO master (the tensor a sub-optimizer steps) -> that sub-optimizer's state of it."""
    return {master: state for sub in hdo.sub_optimizers for master, state in sub.state.items()}


def _sync_hybrid(opt: Any) -> None:
    """After ``HDO.state`` was set by a load: the sub-optimizers take it, masters copied (megatron-core's loaders do)."""
    hdo = _hybrid(opt)
    if hdo is not None and hdo.state:
        hdo._sync_hdo_state_to_sub_optimizers()


def sync_hybrid(optimizer: Any) -> None:
    """``_sync_hybrid`` for each distributed optimizer: after a load by megatron-core's own ``load_state_dict``.

    Its ``dp_reshardable`` and ``dp_zero_gather_scatter`` readers set ``HDO.state`` without passing
    it on to the sub-optimizers (its ``fully_reshardable`` one does; a second sync is harmless).
    """
    for opt in _distributed(optimizer):
        _sync_hybrid(opt)


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
    hdo = _hybrid(opt)
    if hdo is not None:
        return any(len(s) for s in _sub_states(hdo).values())
    return any(len(s) for s in opt.optimizer.state.values())


def _holds_main_params(opt: Any) -> bool:
    """Whether the inner optimizer keeps the main params (``--use-precision-aware-optimizer``: TE's FusedAdam)."""
    return bool(getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def _is_hybrid(opt: Any) -> bool:
    """megatron-core's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``): its own fp32 tensors on the host."""
    return _hybrid(opt) is not None


def stored_form(opt: Any) -> dict:
    """How ``opt`` stores its main params and moments (the kinds compared at load, and the flag)."""
    inner, config = opt.optimizer, opt.config
    dtypes = getattr(inner, "name_to_dtype_map", None) or {}  # TE's FusedAdam: the dtype of each state

    def kind(name: str) -> str:
        dtype = dtypes.get(name, torch.float32)
        return _KINDS.get(dtype, str(dtype).removeprefix("torch."))

    main = "fp32"
    if _holds_main_params(opt) and not _is_hybrid(opt):
        main = kind("master_param")
        if getattr(inner, "store_param_remainders", False) and getattr(config, "bf16", False):
            main = REMAINDERS
    return {"main_params": main, "exp_avg": kind("exp_avg"), "exp_avg_sq": kind("exp_avg_sq"),
            "precision_aware_optimizer": bool(getattr(config, "use_precision_aware_optimizer", False))}


def describe(form: dict) -> str:
    return f"main params {form['main_params']}, exp_avg {form['exp_avg']}, exp_avg_sq {form['exp_avg_sq']}"


def _flags(form: dict) -> str:
    """The Megatron-LM flags that give an optimizer of this stored form."""
    if all(form[k] == "fp32" for k in _COMPARED) and not form.get("precision_aware_optimizer"):
        return "without --use-precision-aware-optimizer"
    main = {REMAINDERS: "fp32", "fp16": "fp16"}.get(form["main_params"], "fp32")
    flags = (f"--use-precision-aware-optimizer --main-params-dtype {main} --exp-avg-dtype {form['exp_avg']} "
             f"--exp-avg-sq-dtype {form['exp_avg_sq']}")
    if form["main_params"] == REMAINDERS:
        flags += " with --bf16 (megatron-core's OptimizerConfig.store_param_remainders, on by default with TE >= 2.1)"
    elif form["main_params"] == "fp32":
        flags += " (with --bf16: OptimizerConfig.store_param_remainders off)"
    return flags


FP8_REFUSED = ("--use-datastates cannot save fp8 optimizer state ({}): Transformer Engine's FusedAdam keeps it as "
               "Float8Tensors, whose exact form (fp8 data plus a per-tensor scale) megatron_ext does not store; use "
               "--exp-avg-dtype/--exp-avg-sq-dtype bf16 (exact in any layout) or fp16 (exact on the saved layout)")


def _refuse_fp8(form: dict) -> None:
    fp8 = [name for name in _COMPARED if form[name] == "fp8"]
    if fp8:
        raise CheckpointError(FP8_REFUSED.format(", ".join(fp8)))


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


def _stored_tensors(opt: Any, model_param: Any, sub_states: dict | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The optimizer's own stored tensors of this rank's slice of ``model_param`` (no copy), and their scales.

    Plain optimizers: megatron-core's fp32 main param and the inner optimizer's moments. With
    ``--use-precision-aware-optimizer`` the inner FusedAdam's state as it stores it (``_stored``);
    before its first step it holds nothing (the main params are the model's own until then). With
    a ``HybridDeviceOptimizer`` the master its sub-optimizer steps and that sub-optimizer's moments
    (``sub_states``: ``_sub_states``, computed here when not given).
    """
    group_index, group_order = opt.model_param_group_index_map[model_param]
    param = opt.optimizer.param_groups[group_index]["params"][group_order]
    slices: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    hdo = _hybrid(opt)
    if hdo is not None:
        master = hdo.param_to_inner_param[param]
        slices["fp32_param"] = master
        state = (_sub_states(hdo) if sub_states is None else sub_states).get(master, {})
    elif _holds_main_params(opt):
        if not _has_stepped(opt):
            return slices, scales
        state = opt.optimizer.state[param]
    else:
        slices["fp32_param"] = param
        if not _has_stepped(opt):  # only the main param exists (reading the state would create empty entries)
            return slices, scales
        state = opt.optimizer.state[param]
    for key, tensor in state.items():
        if key not in ("step", "master_param") or (key == "master_param" and hdo is None):  # step: in param_groups
            more, more_scales = _stored(opt, param, key, tensor)
            slices.update(more)
            scales.update(more_scales)
    return slices, scales


def _param_tensors(opt: Any, model_param: Any, sub_states: dict | None = None) -> dict[str, torch.Tensor]:
    """The optimizer's own stored tensors of this rank's slice of ``model_param``, by shard name (no copy)."""
    return _stored_tensors(opt, model_param, sub_states)[0]


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
    if _has_stepped(opt):
        with _state_dict_without_copies(opt):
            return with_class_names(opt.state_dict())
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": 0}
              for group in opt.optimizer.state_dict()["param_groups"]]
    state: dict = {"optimizer": {"param_groups": groups}}
    if opt.grad_scaler:
        state["grad_scaler"] = opt.grad_scaler.state_dict()
    return with_class_names(state)


def _model_space(opt: Any, by_param: dict) -> dict:
    form = stored_form(opt)
    _refuse_fp8(form)
    state = _common_state(opt)
    param_state = {}
    hdo = _hybrid(opt)
    sub_states = _sub_states(hdo) if hdo is not None else None
    for model_param, flat in _param_slices(opt):
        boxes = by_param.get(model_param)
        if boxes is None or any(len(sharding.replica_tuple(box.shard.replica_id)) != 3 for box in boxes):
            raise ValueError(f"parameter of shape {tuple(model_param.shape)} has no (PP, TP, DP) ShardedTensor "
                             "in the model's sharded state dict")
        slices, scales = _stored_tensors(opt, model_param, sub_states)
        entry: dict[str, Any] = {name: _slice_leaves(opt, boxes, name, tensor, flat) for name, tensor in slices.items()}
        first = boxes[0].shard
        replica_id = (*sharding.replica_tuple(first.replica_id)[:2], opt.distributed_optimizer_instance_id)
        for name, scale in scales.items():  # one value per slice: an object of this rank's slice
            entry[name + SCALE_SUFFIX] = ShardedObject(
                f"optimizer.state.{name}{SCALE_SUFFIX}.{first.key}#{flat.start}:{flat.stop}", scale,
                tuple(first.global_shape), tuple(first.global_offset), replica_id)
        param_state[len(param_state)] = entry
    state["param_state"] = param_state
    state["param_state_sharding_type"] = MODEL_SPACE
    state[STORED_FORM] = form
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


def _saved_states(optimizers: list, saved: Any) -> list:
    """The saved common state of each (chained) optimizer, in order."""
    return [saved] if len(optimizers) == 1 else [saved[i] for i in sorted(saved)]


def _common_states(saved_common: Any) -> list:
    """Each (chained) optimizer's part of a checkpoint's common ``optimizer`` state."""
    if not isinstance(saved_common, dict):
        return []
    return [saved_common] if "param_state_sharding_type" in saved_common else list(saved_common.values())


def _recorded_form(saved: dict) -> dict:
    recorded = saved.get(STORED_FORM)
    return {**PLAIN_FORM, **recorded} if isinstance(recorded, dict) else dict(PLAIN_FORM)


def saved_forms(saved_common: Any) -> list[dict]:
    """The stored form of every model-space optimizer state in a checkpoint's common ``optimizer`` state."""
    return [_recorded_form(saved) for saved in _common_states(saved_common)
            if isinstance(saved, dict) and saved.get("param_state_sharding_type") == MODEL_SPACE]


def is_plain(form: dict) -> bool:
    return all(form[k] == "fp32" for k in _COMPARED)


def check_stored_form(optimizer: Any, saved_common: Any, *, checkpoint: str, resharding: bool) -> None:
    """Refuse, before anything is read, a model-space optimizer state saved in another stored form.

    ``saved_common`` is the checkpoint's common ``optimizer`` state. Checkpoints in megatron-core's
    own formats (converted from torch_dist) hold its unscaled values and are not checked here.
    """
    optimizers = list(_distributed(optimizer))
    if not isinstance(saved_common, dict):
        return
    for opt, saved in zip(optimizers, _saved_states(optimizers, saved_common)):
        if not _is_distributed(opt) or not isinstance(saved, dict) or \
                saved.get("param_state_sharding_type") != MODEL_SPACE:
            continue
        saved_form = _recorded_form(saved)
        now = stored_form(opt)
        if any(saved_form.get(k) != now[k] for k in _COMPARED):
            when = "" if isinstance(saved.get(STORED_FORM), dict) else \
                " (saved before megatron_ext recorded the form: the plain one)"
            raise CheckpointError(
                f"{checkpoint}: its optimizer state was saved in another form than this run's optimizer keeps: saved "
                f"{describe(saved_form)}{when}, now {describe(now)}. Loading it would copy values of one kind into "
                f"tensors of another; resume {_flags(saved_form)} (this run: {_flags(now)}), or pass "
                "--no-load-optim to load the weights only")
        scaled = [k for k in _COMPARED if saved_form[k] == "fp16"]
        if resharding and scaled:
            raise CheckpointError(
                f"{checkpoint}: its optimizer keeps {', '.join(scaled)} in fp16 divided by a scale per parameter "
                "slice of each data-parallel rank, which does not carry over to another TP/PP/DP layout exactly; "
                "load it on the layout it was saved with (or pass --no-load-optim)")


def whole_boxes(saved_common: Any) -> bool:
    """Whether a checkpoint's model-space optimizer state is held as whole parameter boxes (``BOXES``)."""
    return any(isinstance(s, dict) and s.get(BOXES) for s in _common_states(saved_common))


def saved_before_first_step(saved_common: Any) -> bool:
    """Whether a checkpoint's optimizer (its common part) was saved before the first step."""
    return any(isinstance(s, dict) and s.get(BEFORE_FIRST_STEP) for s in _common_states(saved_common))


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
    for opt, opt_state in zip(optimizers, _saved_states(optimizers, state)):
        param_state = opt_state.get("param_state", {})
        stepped = not opt_state.get(BEFORE_FIRST_STEP)
        hdo = _hybrid(opt)
        if hdo is not None and not hdo.state:
            _seed_hybrid_state(hdo)
        # Param groups and grad scaler; with TE's FusedAdam this also re-creates its state tensors,
        # so the stored values are written below, into the tensors it keeps from now on.
        opt.load_state_dict(with_live_classes(opt, {k: v for k, v in opt_state.items() if k not in _OWN_KEYS}))
        if not stepped and hdo is not None:
            _load_hybrid_before_first_step(opt, param_state)
            continue
        for index, (model_param, _) in enumerate(_param_slices(opt)):
            loaded = {k: _joined(v) for k, v in param_state[index].items()}
            slices, scales = _hybrid_load_targets(opt, model_param) if hdo is not None else \
                _stored_tensors(opt, model_param)
            targets = {**slices, **{name + SCALE_SUFFIX: scale for name, scale in scales.items()}}
            with torch.no_grad():  # in fp32 the main params are the model's own (leaf) params
                for name, tensor in targets.items():
                    if name in loaded and loaded[name] is not tensor:
                        tensor.copy_(loaded[name])
        _sync_hybrid(opt)
        if not stepped:  # saved before the first step: so is this optimizer now (its next step starts the moments)
            opt.optimizer.state.clear()
    restore_adam_steps(optimizer)


def _hybrid_load_targets(opt: Any, model_param: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """Where a load writes a ``HybridDeviceOptimizer``'s state: ``HDO.state``, as megatron-core's loaders do.

    ``load_state_dict`` has just rebuilt ``HDO.state`` (copies of the state the sub-optimizers had
    before); ``_sync_hybrid`` then hands it to the sub-optimizers and copies its masters into the
    tensors they step. Writing the sub-optimizers' old tensors instead would be undone by that sync.
    """
    hdo = _hybrid(opt)
    group_index, group_order = opt.model_param_group_index_map[model_param]
    param = opt.optimizer.param_groups[group_index]["params"][group_order]
    state = hdo.state.get(param, {})
    targets = {"fp32_param": state.get("master_param", hdo.param_to_inner_param[param])}
    targets.update({k: v for k, v in state.items() if k not in ("step", "master_param") and isinstance(v, torch.Tensor)})
    return targets, {}


def _seed_hybrid_state(hdo: Any) -> None:
    """``HDO.state`` of masters only, for a load into an HDO that has not stepped (nor been allocated).

    megatron-core's ``load_state_dict`` would otherwise first step it with random gradients
    (``dummy_step``), whose copy-back hooks write the stepped masters over the model's shards,
    loaded by then. Only a checkpoint saved before the first step is loaded this way (any other
    load allocates the state before the weights are read, ``allocate_state``).
    """
    for group in hdo.param_groups:
        for param in group["params"]:
            hdo.state[param] = {"master_param": hdo.param_to_inner_param[param]}


def _load_hybrid_before_first_step(opt: Any, param_state: dict) -> None:
    """A ``HybridDeviceOptimizer`` saved before its first step: masters loaded, no state anywhere.

    As one that has not stepped: its sub-optimizers and ``HDO.state`` are empty, and the masters
    they will step hold the saved fp32 values.
    """
    from collections import defaultdict

    hdo = _hybrid(opt)
    for sub in hdo.sub_optimizers:
        sub.state = defaultdict(dict)
    hdo.state = defaultdict(dict)
    with torch.no_grad():
        for index, (model_param, _) in enumerate(_param_slices(opt)):
            _param_tensors(opt, model_param)["fp32_param"].copy_(param_state[index]["fp32_param"])


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


@contextlib.contextmanager
def steps_set_aside(optimizer: Any) -> Iterator[None]:
    """Within the block megatron-core's per-parameter state setter leaves torch Adam's ``step`` alone.

    megatron-core 0.16.1 copies every entry of a parameter's optimizer state from the loaded
    tensors (``_set_main_param_and_optimizer_states``), but its ``dp_zero_gather_scatter`` and
    ``fully_reshardable`` loads hand it no ``step``, which only torch's Adam keeps per parameter
    (a fused Adam on GPUs has none): it would fail with ``KeyError: 'step'``. ``restore_adam_steps``
    sets ``step`` from the param groups afterwards.
    """
    patched = []
    for opt in _distributed(optimizer):
        setter = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if setter is None or not hasattr(opt, "model_param_group_index_map"):
            continue

        def set_states(model_param, tensors, opt=opt, setter=setter):
            if "step" in tensors or getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                return setter(model_param, tensors)
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state.get(opt.optimizer.param_groups[group_index]["params"][group_order], {})
            step = state.pop("step", None)
            try:
                return setter(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


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
                    # On the device the optimizer keeps it (a fused or capturable Adam's is its param's).
                    device = state["step"].device if isinstance(state["step"], torch.Tensor) else None
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32, device=device)


def check_param_groups(optimizer: Any, saved: Any) -> None:
    """Every param group of this rank must be among the saved ones (rank 0's, in ``common``).

    The non-parameter state is saved once, by global rank 0, and loaded on every rank, whatever
    its pipeline stage and layout; megatron-core matches groups by their identity keys
    (``wd_mult``, ``lr_mult``, ...), so a stage with a kind of group rank 0's stage lacks cannot load.
    """
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    optimizers = list(_distributed(optimizer))
    for opt, state in zip(optimizers, _saved_states(optimizers, saved)):
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
    for opt, opt_state in zip(optimizers, _saved_states(optimizers, state)):
        if not _is_distributed(opt):
            opt.load_state_dict(opt_state)
            continue
        param_state = opt_state["param_state"]
        opt.load_state_dict(with_live_classes(opt, {k: v for k, v in opt_state.items()
                                                if k not in ("param_state", "param_state_sharding_type")}))
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
                    else:  # megatron-core's names for the plain optimizer's own tensors (no copies there)
                        with torch.no_grad():
                            for name, tensor in opt._get_main_param_and_optimizer_states(model_param).items():
                                if name != "step":
                                    tensor.copy_(sliced[name])
                index += 1
        _sync_hybrid(opt)
    restore_adam_steps(optimizer)
