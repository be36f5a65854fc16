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

Loading, on the torch-Adam path (no Transformer Engine or Apex, as on CPUs):

* a fresh optimizer has no Adam state yet, and ``DistributedOptimizer.state_dict()`` fails
  without it, so ``ensure_state`` allocates it (values are overwritten by the load);
* after the load every param shares one ``step`` tensor holding the pre-load value, so
  ``restore_adam_steps`` gives each param its own ``step`` equal to the checkpointed count kept
  in ``param_groups[i]['step']``.

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

from typing import Any, Iterator

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_ext.megatron import sharding

MODEL_SPACE = "fully_sharded_model_space"
BEFORE_FIRST_STEP = "saved_before_first_step"


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

    Its ``dp_reshardable`` reader sets ``HDO.state`` without passing it on to the sub-optimizers.
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
    by_param = {shard.data: shard for shard in sharding.sharded_leaves(model_sharded)
                if isinstance(shard, ShardedTensor)}
    states = [_model_space(opt, by_param) for opt in optimizers]
    return states[0] if len(states) == 1 else dict(enumerate(states))


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


def _param_tensors(opt: Any, model_param: Any, sub_states: dict | None = None) -> dict[str, torch.Tensor]:
    """The optimizer's own fp32 main param and Adam moments of this rank's slice of ``model_param``.

    With a ``HybridDeviceOptimizer``, the master its sub-optimizer steps and that sub-optimizer's
    moments (``sub_states``: ``_sub_states``, None before the first step).
    """
    group_index, group_order = opt.model_param_group_index_map[model_param]
    hdo = _hybrid(opt)
    if hdo is not None:
        master = hdo.param_to_inner_param[hdo.param_groups[group_index]["params"][group_order]]
        state = (sub_states or {}).get(master, {})
        return {"fp32_param": master, **{k: v for k, v in state.items() if k not in ("step", "master_param")}}
    if not _has_stepped(opt):  # only the main param exists (reading the state would create empty entries)
        return {"fp32_param": opt.optimizer.param_groups[group_index]["params"][group_order]}
    tensors = opt._get_main_param_and_optimizer_states(model_param)
    tensors["fp32_param"] = tensors.pop("param")
    tensors.pop("step", None)  # kept in param_groups (one count for all params)
    return tensors


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
        return with_class_names(opt.state_dict())
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "step": 0}
              for group in opt.optimizer.state_dict()["param_groups"]]
    state: dict = {"optimizer": {"param_groups": groups}}
    if opt.grad_scaler:
        state["grad_scaler"] = opt.grad_scaler.state_dict()
    return with_class_names(state)


def _model_space(opt: Any, by_param: dict) -> dict:
    state = _common_state(opt)
    param_state = {}
    hdo = _hybrid(opt)
    sub_states = _sub_states(hdo) if hdo is not None else None
    for model_param, flat in _param_slices(opt):
        model_shard = by_param.get(model_param)
        if model_shard is None or len(model_shard.replica_id) != 3:
            raise ValueError(f"parameter of shape {tuple(model_param.shape)} has no (PP, TP, DP) ShardedTensor "
                             "in the model's sharded state dict")
        replica_id = (*model_shard.replica_id[:2], opt.distributed_optimizer_instance_id)
        param_state[len(param_state)] = {
            name: sharding.flat_shard(model_shard, f"optimizer.state.{name}.{model_shard.key}", tensor, flat,
                                      replica_id)
            for name, tensor in _param_tensors(opt, model_param, sub_states).items()}
    state["param_state"] = param_state
    state["param_state_sharding_type"] = MODEL_SPACE
    if not _has_stepped(opt):
        state[BEFORE_FIRST_STEP] = True  # main params only: the load template must not ask for moments
    return state


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
        stepped = not opt_state.get(BEFORE_FIRST_STEP)
        hdo = _hybrid(opt)
        if hdo is not None and not hdo.state:
            _seed_hybrid_state(hdo)
        opt.load_state_dict(with_live_classes(opt, {k: v for k, v in opt_state.items()
                                                if k not in ("param_state", "param_state_sharding_type",
                                                             BEFORE_FIRST_STEP)}))
        scaled = getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        if not stepped and hdo is not None:
            _load_hybrid_before_first_step(opt, param_state)
            continue
        for index, (model_param, _) in enumerate(_param_slices(opt)):
            if scaled:  # the optimizer keeps scaled copies: megatron-core's own setter rescales
                loaded = param_state[index]
                opt._set_main_param_and_optimizer_states(
                    model_param, {"param" if k == "fp32_param" else k: v for k, v in loaded.items()})
                continue
            with torch.no_grad():  # in fp32 the main params are the model's own (leaf) params
                for name, tensor in _param_tensors(opt, model_param).items():
                    if name in param_state[index]:
                        tensor.copy_(param_state[index][name])
        _sync_hybrid(opt)
        if not stepped:  # saved before the first step: so is this optimizer now (its next step starts the moments)
            opt.optimizer.state.clear()
    restore_adam_steps(optimizer)


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
                    else:
                        for name, tensor in _param_tensors(opt, model_param).items():
                            tensor.copy_(sliced["param" if name == "fp32_param" else name])
                index += 1
        _sync_hybrid(opt)
    restore_adam_steps(optimizer)
