"""Consolidated weights of a DeepSpeed checkpoint saved with ``datastates_ckpt`` (ZeRO 0-3).

What DeepSpeed's own ``zero_to_fp32.py`` does for its ``torch.save`` files, done here for this
project's files (``megatron-ext export``): DeepSpeed's copy of that script, placed in every save
directory, cannot read them (it ``torch.load``s the pointer files and fails with
``UnpicklingError: invalid load key, '{'``). Only the sub-trees that hold plain values and tensors
are read, so no DeepSpeed class is rebuilt and DeepSpeed need not be installed.

The layout DeepSpeed 0.19 saves (one ``global_stepN`` directory per tag):

* ``mp_rank_00_model_states.pt`` (ZeRO 0-2) or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per
  data-parallel rank ``r`` (ZeRO-3): ``module`` (the module's state dict; ZeRO-3 holds empty
  placeholders for partitioned parameters), ``buffer_names``, ``param_shapes`` (per optimizer
  param group, name -> shape, in the order the optimizer flattened them), ``shared_params``
  (alias -> parameter), ``frozen_param_shapes`` and ``frozen_param_fragments``;
* ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank: ``optimizer_state_dict`` with the
  rank's fp32 master weights, ``single_partition_of_fp32_groups`` (ZeRO 1-2: one flat partition
  per group; the group's parameters lie back to back in the concatenation of all ranks'
  partitions, each followed by ``param_alignment_paddings[group][i]`` elements) or
  ``fp32_flat_groups`` (ZeRO-3: each parameter is split into ``ceil(numel / world)`` elements per
  rank, padded at the end; a rank's groups concatenated hold its pieces in ``param_shapes`` order).

The export gives those fp32 master weights (``--dtype bf16`` casts them), the buffers as saved,
frozen parameters from their fragments, and shared parameters under every name. Not supported
(refused): model parallelism (``mp_rank_01``...) and pipeline-engine checkpoints (``layer_*``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.read.committed import CommittedCheckpoint
from megatron_ext.megatron.hf_gpt2 import OutputTensor

MODEL_SUFFIX, OPTIM_SUFFIX = "_model_states.pt", "_optim_states.pt"
ZERO12_KEY, ZERO3_KEY = "single_partition_of_fp32_groups", "fp32_flat_groups"
OPTIMIZER = "optimizer_state_dict"


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _part(reader: Any, *keys: str, default: Any = None) -> Any:
    return reader.part(*keys) if reader.has_part(*keys) else default


def _raw_stage(reader: Any) -> int | None:
    """The ZeRO stage as saved (``ZeroStageEnum``, read from the sidecar without rebuilding the class)."""
    node = reader.skeleton()
    for key in (OPTIMIZER, "zero_stage"):
        if type(node) is not dict or key not in node:
            return None
        node = node[key]
    if type(node) is dict and type(node.get("$enum")) is list and len(node["$enum"]) == 3:
        node = node["$enum"][2]
    return node if type(node) is int else None


def _numel(shape: Any) -> int:
    return math.prod(tuple(shape))


def plan(committed: CommittedCheckpoint, dtype: torch.dtype | None) -> tuple[list[OutputTensor], dict]:
    """The output tensors of a DeepSpeed checkpoint and a summary of what they are."""
    names = sorted((file.name for file in committed.files()), key=_natural)
    bad = [n for n in names if re.search(r"mp_rank_(?!00_)\d+", n) or n.startswith("layer_")]
    if bad:
        raise CheckpointError(f"{committed.checkpoint}: {bad[0]} belongs to a model-parallel or pipeline DeepSpeed "
                              "checkpoint, which export does not consolidate (data-parallel ZeRO 0-3 only)")
    model_files = [n for n in names if n.endswith(MODEL_SUFFIX)]
    optim_files = [n for n in names if n.endswith(OPTIM_SUFFIX)]
    if not model_files:
        raise CheckpointError(f"{committed.checkpoint}: no *{MODEL_SUFFIX} file; not a DeepSpeed checkpoint")
    model = committed.reader(model_files[0])
    param_shapes = _part(model, "param_shapes")
    buffer_names = set(_part(model, "buffer_names", default=[]) or [])
    shared = _part(model, "shared_params", default={}) or {}
    module = model.part("module")
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {"ds_version": _part(model, "ds_version")}

    optim = [committed.reader(n) for n in optim_files]
    key = next((k for k in (ZERO12_KEY, ZERO3_KEY) if optim and optim[0].has_part(OPTIMIZER, k)), None)
    if key is None or param_shapes is None:
        # No ZeRO partitions (stage 0): the module's own state dict is complete.
        info.update(zero_stage=0, weights="the module's state dict as saved")
        tensors.update({k: v for k, v in module.items() if isinstance(v, torch.Tensor)})
    else:
        stage = _raw_stage(optim[0]) or (3 if key == ZERO3_KEY else 2)
        world = len(optim)
        counts = optim[0].part(OPTIMIZER, "partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != world:
            raise CheckpointError(f"{committed.checkpoint}: the optimizer was partitioned over {count} ranks, but "
                                  f"{world} *{OPTIM_SUFFIX} files are committed")
        groups = [r.part(OPTIMIZER, key) for r in optim]
        if key == ZERO12_KEY:
            paddings = _part(optim[0], OPTIMIZER, "param_alignment_paddings")
            tensors.update(_zero12(groups, param_shapes, paddings, committed.checkpoint))
            frozen = _part(model, "frozen_param_fragments", default={}) or {}
            tensors.update({k: v for k, v in frozen.items() if isinstance(v, torch.Tensor)})
        else:
            tensors.update(_zero3(groups, param_shapes, committed.checkpoint))
            frozen_shapes = _part(model, "frozen_param_shapes", default={}) or {}
            if frozen_shapes:
                fragments = [committed.reader(n).part("frozen_param_fragments") for n in model_files]
                for name, shape in frozen_shapes.items():
                    whole = torch.cat([f[name].reshape(-1) for f in fragments])
                    tensors[name] = whole[:_numel(shape)].view(tuple(shape))
        info.update(zero_stage=stage, dp_world_size=world,
                    weights="fp32 master weights consolidated from the optimizer partitions")
        for name in buffer_names:
            if isinstance(module.get(name), torch.Tensor):
                tensors[name] = module[name]
    for alias, target in (shared.items() if isinstance(shared, dict) else ()):
        if target in tensors:
            tensors[alias] = tensors[target]
    ordered = [k for k in module if k in tensors] + sorted(k for k in tensors if k not in module)
    out = []
    for name in ordered:
        tensor = tensors[name]
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        out.append(OutputTensor(name, tuple(tensor.shape), out_dtype,
                                lambda t=tensor, d=out_dtype: t.to(d).contiguous()))
    return out, info


def _zero12(groups: list[list[torch.Tensor]], param_shapes: list[dict], paddings: Any,
            where: str) -> dict[str, torch.Tensor]:
    """ZeRO 1-2: each group's ranks' partitions joined, then cut into the parameters in order."""
    out: dict[str, torch.Tensor] = {}
    if any(len(g) != len(param_shapes) for g in groups):
        raise CheckpointError(f"{where}: {len(param_shapes)} param groups in the model states, "
                              f"{[len(g) for g in groups]} in the optimizer partitions")
    for index, shapes in enumerate(param_shapes):
        flat = torch.cat([rank_groups[index].reshape(-1) for rank_groups in groups])
        pads = paddings[index] if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CheckpointError(f"{where}: group {index} has {len(shapes)} parameters but {len(pads)} paddings")
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            numel = _numel(shape)
            if offset + numel > flat.numel():
                raise CheckpointError(f"{where}: group {index} ends at element {flat.numel()}, parameter {name} "
                                      f"needs {offset}..{offset + numel}")
            out[name] = flat[offset:offset + numel].view(tuple(shape))
            offset += numel + pad
        # What is left is DeepSpeed's padding of the group to a multiple of 2 x ranks elements.
        align = 2 * len(groups)
        if -(-offset // align) != -(-flat.numel() // align):
            raise CheckpointError(f"{where}: group {index} holds {flat.numel()} elements, the parameters "
                                  f"{offset}: the partitions do not match the model states")
    return out


def _zero3(groups: list[list[torch.Tensor]], param_shapes: list[dict], where: str) -> dict[str, torch.Tensor]:
    """ZeRO-3: every rank holds ``ceil(numel / ranks)`` elements of each parameter, in order."""
    world = len(groups)
    flats = [torch.cat([g.reshape(-1) for g in rank_groups]) for rank_groups in groups]
    sizes = {f.numel() for f in flats}
    if len(sizes) != 1:
        raise CheckpointError(f"{where}: the ranks' fp32 partitions differ in size: {sorted(sizes)}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = _numel(shape)
            piece = -(-numel // world)
            if offset + piece > flats[0].numel():
                raise CheckpointError(f"{where}: parameter {name} needs elements {offset}..{offset + piece} of each "
                                      f"rank's {flats[0].numel()}")
            whole = torch.cat([flat[offset:offset + piece] for flat in flats])
            out[name] = whole[:numel].view(tuple(shape))
            offset += piece
    if offset != flats[0].numel():
        raise CheckpointError(f"{where}: the parameters take {offset} elements of each rank's partition, which "
                              f"holds {flats[0].numel()}: the partitions do not match the model states")
    return out


__all__ = ["plan"]
