"""Loading the optimizer's state: the model-space state (``optimizer_state.py``) written back into
the optimizer's own tensors, and the repairs megatron-core's own loads need on torch Adam.

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
from typing import Any, Iterator

import torch

from megatron_ext.engine.errors import CheckpointError
from megatron_ext.megatron.optimizer_forms import (
    BEFORE_FIRST_STEP,
    OWN_KEYS,
    SCALE_SUFFIX,
    STORED_FORM,
    distributed_optimizers,
    hybrid_optimizer,
    is_distributed,
    param_slices,
    saved_states,
)
from megatron_ext.megatron.optimizer_state import param_tensors, stored_tensors, with_live_classes


def sync_hybrid(optimizer: Any) -> None:
    """``_sync_hybrid`` for each distributed optimizer: after a load by megatron-core's own ``load_state_dict``.

    Its ``dp_reshardable`` and ``dp_zero_gather_scatter`` readers set ``HDO.state`` without passing
    it on to the sub-optimizers (its ``fully_reshardable`` one does; a second sync is harmless).
    """
    for opt in distributed_optimizers(optimizer):
        _sync_hybrid(opt)


def _sync_hybrid(opt: Any) -> None:
    """``HDO.state`` set by a load handed to the sub-optimizers, masters copied (as megatron-core's loaders do)."""
    hdo = hybrid_optimizer(opt)
    if hdo is not None and hdo.state:
        hdo._sync_hdo_state_to_sub_optimizers()


def load_model_space_state_dict(optimizer: Any, state: Any) -> None:
    """Inverse of ``model_space_state_dict``, its ShardedTensors replaced by the loaded tensors.

    megatron-core's own reader of this format (``load_parameter_state_from_fs_model_space``)
    fails on torch Adam, whose per-param state also holds ``step``; the values are copied into
    the optimizer's tensors here instead, and ``step`` comes from the param groups.
    """
    optimizers = list(distributed_optimizers(optimizer))
    if not all(is_distributed(opt) for opt in optimizers):
        for part in saved_states(optimizers, state):  # the stored form: compared before the load, not megatron-core's
            if isinstance(part, dict):
                part.pop(STORED_FORM, None)
        optimizer.load_state_dict(state)
        restore_adam_steps(optimizer)
        return
    for opt, opt_state in zip(optimizers, saved_states(optimizers, state)):
        param_state = opt_state.get("param_state", {})
        stepped = not opt_state.get(BEFORE_FIRST_STEP)
        hdo = hybrid_optimizer(opt)
        if hdo is not None and not hdo.state:
            _seed_hybrid_state(hdo)
        # Param groups and grad scaler; with TE's FusedAdam this also re-creates its state tensors,
        # so the stored values are written below, into the tensors it keeps from now on.
        opt.load_state_dict(with_live_classes(opt, {k: v for k, v in opt_state.items() if k not in OWN_KEYS}))
        if not stepped and hdo is not None:
            _load_hybrid_before_first_step(opt, param_state)
            continue
        for index, (model_param, _) in enumerate(param_slices(opt)):
            loaded = {k: _joined(v) for k, v in param_state[index].items()}
            slices, scales = _hybrid_load_targets(opt, model_param) if hdo is not None else \
                stored_tensors(opt, model_param)
            targets = {**slices, **{name + SCALE_SUFFIX: scale for name, scale in scales.items()}}
            with torch.no_grad():  # in fp32 the main params are the model's own (leaf) params
                for name, tensor in targets.items():
                    if name in loaded and loaded[name] is not tensor:
                        tensor.copy_(loaded[name])
        _sync_hybrid(opt)
        if not stepped:  # saved before the first step: so is this optimizer now (its next step starts the moments)
            opt.optimizer.state.clear()
    restore_adam_steps(optimizer)


def _joined(loaded: Any) -> torch.Tensor:
    """A loaded slice: one tensor, or the pieces the save cut it into (``optimizer_state._slice_leaves``), joined."""
    if isinstance(loaded, dict):
        return torch.cat([loaded[k].reshape(-1) for k in sorted(loaded)])
    return loaded


def _hybrid_load_targets(opt: Any, model_param: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """Where a load writes a ``HybridDeviceOptimizer``'s state: ``HDO.state``, as megatron-core's loaders do.

    ``load_state_dict`` has just rebuilt ``HDO.state`` (copies of the state the sub-optimizers had
    before); ``_sync_hybrid`` then hands it to the sub-optimizers and copies its masters into the
    tensors they step. Writing the sub-optimizers' old tensors instead would be undone by that sync.
    """
    hdo = hybrid_optimizer(opt)
    group_index, group_order = opt.model_param_group_index_map[model_param]
    param = opt.optimizer.param_groups[group_index]["params"][group_order]
    state = hdo.state.get(param, {})
    targets = {"fp32_param": state.get("master_param", hdo.param_to_inner_param[param])}
    targets.update({k: v for k, v in state.items()
                    if k not in ("step", "master_param") and isinstance(v, torch.Tensor)})
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

    hdo = hybrid_optimizer(opt)
    for sub in hdo.sub_optimizers:
        sub.state = defaultdict(dict)
    hdo.state = defaultdict(dict)
    with torch.no_grad():
        for index, (model_param, _) in enumerate(param_slices(opt)):
            param_tensors(opt, model_param)["fp32_param"].copy_(param_state[index]["fp32_param"])


def ensure_state(optimizer: Any) -> None:
    for opt in distributed_optimizers(optimizer):
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
    for opt in distributed_optimizers(optimizer):
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

    megatron-core 0.19.0 copies every entry of a parameter's optimizer state from the loaded
    tensors (``_set_main_param_and_optimizer_states``), but its ``dp_zero_gather_scatter`` and
    ``fully_reshardable`` loads hand it no ``step``, which only torch's Adam keeps per parameter
    (a fused Adam on GPUs has none): it would fail with ``KeyError: 'step'``. ``restore_adam_steps``
    sets ``step`` from the param groups afterwards.
    """
    patched = []
    for opt in distributed_optimizers(optimizer):
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
    for opt in distributed_optimizers(optimizer):
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


def param_group_identity(group: dict) -> tuple:
    """A param group's identity, as megatron-core matches saved groups to the optimizer's: each of its
    ``param_group_identifier_keys`` (``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ...) read as the
    key, else its ``pre_`` alias (NeMo's), else None."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group[k] if k in group else group.get(f"pre_{k}") for k in param_group_identifier_keys)


def unmatched_param_groups(groups: list[dict], saved_groups: list[dict]) -> list[tuple]:
    """The identities of ``groups`` that none of ``saved_groups`` has (megatron-core's load refuses each)."""
    have = {param_group_identity(g) for g in saved_groups}
    return sorted({param_group_identity(g) for g in groups} - have, key=repr)


def check_param_groups(optimizer: Any, saved: Any) -> None:
    """Every param group of this rank must be among the saved ones (rank 0's, in ``common``).

    The non-parameter state is saved once, by global rank 0, and loaded on every rank, whatever
    its pipeline stage and layout; megatron-core matches groups by their identity
    (``param_group_identity``), so a stage with a kind of group rank 0's stage lacks cannot load.
    """
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    optimizers = list(distributed_optimizers(optimizer))
    for opt, state in zip(optimizers, saved_states(optimizers, saved)):
        if not is_distributed(opt):
            continue
        missing = unmatched_param_groups(opt.optimizer.param_groups, state["optimizer"]["param_groups"])
        if missing:
            raise CheckpointError(f"optimizer param groups {missing} (by {param_group_identifier_keys}) "
                                  "are not in the checkpoint's, which global rank 0 saved")


def load_fully_reshardable_state_dict(optimizer: Any, state: Any) -> None:
    """megatron-core's ``fully_reshardable`` optimizer state (whole parameter boxes) into this rank's slices.

    What ``DistributedOptimizer.load_parameter_state_from_fully_reshardable`` does, which fails on
    torch Adam (its per-parameter state also holds ``step``, as on CPUs without Transformer Engine
    or Apex): ``param_state[i]`` belongs to the ``i``-th parameter of the grad buffers'
    ``param_index_map`` order, all ranks' parameters counted; each rank copies its slice.
    """
    optimizers = list(distributed_optimizers(optimizer))
    for opt, opt_state in zip(optimizers, saved_states(optimizers, state)):
        if not is_distributed(opt):
            opt.load_state_dict(opt_state)
            continue
        param_state = opt_state["param_state"]
        opt.load_state_dict(with_live_classes(opt, {k: v for k, v in opt_state.items()
                                                if k not in ("param_state", "param_state_sharding_type")}))
        scaled = getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        local = dict(param_slices(opt))
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

