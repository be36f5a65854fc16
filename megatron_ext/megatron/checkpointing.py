"""Drop-in ``save_checkpoint`` / ``load_checkpoint`` for Megatron-LM, backed by the lazy engine.

The signatures are those of ``megatron/training/checkpointing.py`` at the pinned commit, so the
patch set only re-routes calls here. The layout stays Megatron's: ``<save>/iter_0000123/`` per
checkpoint and ``<save>/latest_checkpointed_iteration.txt``, which rank 0 writes (atomically)
only once the checkpoint is committed, i.e. every rank's bytes are durable.

What each rank writes (one file per rank and checkpoint):

* ``shards``: the model and distributed-optimizer shards this rank owns (``sharding.py``), as
  zero-copy views, with their global placement; the optimizer's state is described per parameter
  (``optimizer_state.py``, model space): each data-parallel rank's slices of the fp32 main params
  and Adam moments are its own shards (no gather);
* ``rng``: this rank's Python, NumPy, torch, CUDA and model-parallel tracker RNG states;
* on global rank 0 only, ``common``: the non-sharded part of the state dict, the iteration,
  the scheduler, the consumed samples and the args (copied at save time).

Loading into the same TP/PP/DP layout reads each shard by id; into another layout, each shard
is assembled from the saved shards that overlap it (``shard_assembly.py``), and RNGs are
reseeded deterministically (``reseed_rngs``).

``save_checkpoint`` returns as soon as the engine has recorded the tensors; the copies overlap
with the next forward/backward, and ``install_lazy_wait`` makes the optimizer wait right before
its inner step (``step_with_ready_grads``), after gradient preparation and clipping.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, Callable

import numpy as np
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed
from megatron_ext.engine.files import atomic_write
from megatron_ext.megatron import optimizer_state, sharding
from megatron_ext.megatron.args import engine_config_from_args
from megatron_ext.megatron.safe_classes import megatron_classes, megatron_safe_classes
from megatron_ext.megatron.shard_assembly import SavedShards

log = logging.getLogger("megatron_ext.megatron")

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # the Megatron-LM checkpoint version this layout answers to
DP_RESHARDABLE = "dp_reshardable"

_engine: CheckpointEngine | None = None
_engine_key: tuple | None = None
_plan: sharding.OwnershipPlan | None = None
_args: Any = None


# ---------------------------------------------------------------------------- configuration
def set_args(args: Any) -> None:
    """For trainers without ``megatron.training`` (the PyPI megatron-core has none)."""
    global _args
    _args = args


def _get_args() -> Any:
    if _args is not None:
        return _args
    try:
        from megatron.training import get_args  # present in a Megatron-LM checkout only
    except ImportError as exc:
        raise RuntimeError("megatron_ext.megatron.checkpointing.set_args(args) was not called") from exc
    return get_args()


def get_engine(args: Any | None = None) -> CheckpointEngine:
    """The process's engine, created on first use (its host cache then allocates in the background)."""
    global _engine, _engine_key
    args = args or _get_args()
    cfg = engine_config_from_args(args)
    cfg["safe_classes"] = list(megatron_safe_classes()) + list(cfg.get("safe_classes") or [])
    key = tuple(sorted((k, str(v)) for k, v in cfg.items()))
    if _engine is None:
        _engine = CheckpointEngine(cfg)
        _engine_key = key
    elif key != _engine_key:
        raise CheckpointError("the datastates configuration changed during the run; it is fixed at the first save")
    return _engine


def current_engine() -> CheckpointEngine | None:
    return _engine


def install_lazy_wait(optimizer: Any, engine: CheckpointEngine) -> None:
    """Make ``optimizer.step_with_ready_grads`` wait for pending snapshots first (idempotent)."""
    if optimizer is None or getattr(optimizer, "_datastates_lazy_wait", False):
        return
    inner_step = optimizer.step_with_ready_grads

    def step_with_ready_grads(*args: Any, **kwargs: Any):
        engine.wait_snapshot()
        return inner_step(*args, **kwargs)

    optimizer.step_with_ready_grads = step_with_ready_grads
    optimizer._datastates_lazy_wait = True


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# ---------------------------------------------------------------------------- state pieces
def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _unwrap(model: Any) -> list:
    """The bare model chunks (no DDP or Float16Module wrappers), as Megatron-LM saves them."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model if isinstance(model, list) else [model])


def _model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _sharded_state(model: list, optimizer: Any, with_optimizer: bool, optimizer_format: str | None = None) -> dict:
    """The sharded state dict saved (model-space optimizer) or to load into (the checkpoint's optimizer format).

    ``dp_reshardable`` (megatron-core's bucket-space format, which checkpoints converted from
    torch_dist and those saved before the model-space format carry) is built by megatron-core.
    """
    sharded = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(model), model)}
    if with_optimizer and optimizer is not None:
        if optimizer_format == DP_RESHARDABLE:
            sharded["optimizer"] = optimizer.sharded_state_dict(
                sharded, is_loading=True, metadata={"distrib_optim_sharding_type": DP_RESHARDABLE})
        else:
            sharded["optimizer"] = optimizer_state.model_space_state_dict(optimizer, sharded)
    return sharded


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "world_size": torch.distributed.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
    }


def _dp_gather() -> Callable[[Any], list]:
    from megatron.core import parallel_state as ps

    try:
        group = ps.get_data_parallel_group_gloo(with_context_parallel=True)
    except (AssertionError, AttributeError, RuntimeError):
        group = ps.get_data_parallel_group(with_context_parallel=True)

    def gather(obj: Any) -> list:
        out: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    return gather


def _ownership(shards: list) -> sharding.OwnershipPlan:
    global _plan
    signature = sharding.candidate_signature(shards)
    if _plan is None:
        layout = _layout()
        _plan = sharding.plan_ownership(shards, layout["dp_rank"], layout["dp"], _dp_gather())
        log.info("[datastates] shard ownership: bytes per data-parallel rank %s", _plan.bytes_by_dp_rank)
    elif _plan.signature != signature:
        raise CheckpointError("the model's sharded state changed between checkpoints; restart to re-plan")
    return _plan


# ---------------------------------------------------------------------------- save
def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
                    tp_group=None, pp_group=None, dp_cp_group=None):
    """Record iteration ``iteration``'s state and return; flush and commit happen in the background."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    args = _get_args()
    if non_persistent_ckpt:
        raise CheckpointError("--use-datastates does not support non-persistent checkpoints; "
                              "use --save-interval (the engine is already asynchronous)")
    started = time.monotonic()
    model = _unwrap(model)
    engine = get_engine(args)
    install_lazy_wait(optimizer, engine)
    with_optimizer = not getattr(args, "no_save_optim", False)
    sharded, common = save_preprocess(_sharded_state(model, optimizer, with_optimizer),
                                      validate_access_integrity=False)
    shards = list(sharding.sharded_leaves(sharded))
    plan = _ownership(shards)
    tensors, objects, meta = sharding.split_owned(shards, plan)
    rank = torch.distributed.get_rank()
    layout = _layout()
    state: dict[str, Any] = {"shards": {"tensors": tensors, "objects": objects, "meta": meta}}
    if not getattr(args, "no_save_rng", False):
        state["rng"] = rng_state()
    if rank == 0:
        if preprocess_common_state_dict_fn is not None:
            common = preprocess_common_state_dict_fn(common)
        state["common"] = common
        state["meta"] = {
            "iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
            "scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
            "args": _storable_args(args),
            "layout": layout,
        }
    name = checkpoint_name(iteration)
    engine.save(state, name, f"rank{rank:05d}", version=iteration,
                extra={"objects": sorted(objects), "layout": layout})
    engine.commit(name, on_committed=_tracker_writer(args.save, iteration, rank))
    log.info("[datastates] iteration %d: checkpoint recorded in %.4fs (%d tensors, %d objects owned here)",
             iteration, time.monotonic() - started, len(tensors), len(objects))


def _storable_args(args: Any) -> Any:
    """A copy of args whose values the safe sidecar can hold; others become their repr()."""
    import argparse

    from megatron_ext.engine.codec import EncodeError, Encoder

    plain = argparse.Namespace()
    for key, value in vars(args).items():
        try:
            Encoder(classes=megatron_classes()).encode(value)
        except EncodeError:
            value = repr(value)  # inert: a class not on the allow-list is never rebuilt at load
        setattr(plain, key, value)
    return plain


def _tracker_writer(save_dir: str, iteration: int, rank: int) -> Callable[[dict], None]:
    def write_tracker(manifest: dict) -> None:
        if rank == 0:
            atomic_write(os.path.join(save_dir, TRACKER), str(iteration).encode())
            log.info("[datastates] committed %s (%d files)", checkpoint_name(iteration), len(manifest["files"]))

    return write_tracker


def finalize_checkpoints(blocking: bool = False, terminate: bool = False) -> None:
    """Megatron's ``maybe_finalize_async_save`` hook, called every iteration and at the end.

    Non-blocking calls surface background failures on the training thread; blocking ones wait
    until every pending checkpoint is committed (end of training, exit signal); ``terminate``
    also stops the engine's threads.
    """
    if _engine is None:
        return
    if terminate:
        shutdown()
    elif blocking:
        _engine.wait_persisted()
    else:
        _engine.raise_if_failed()


def shutdown() -> None:
    global _engine, _plan
    if _engine is not None:
        _engine.shutdown()
    _engine, _plan = None, None


# ---------------------------------------------------------------------------- load
def read_tracker(load_dir: str) -> int | None:
    try:
        with open(os.path.join(load_dir, TRACKER), encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{os.path.join(load_dir, TRACKER)} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None,
                    pp_group=None, dp_cp_group=None):
    """Load the newest committed checkpoint; returns ``(iteration, num_floating_point_operations_so_far)``.

    Every file read is checked against the manifest's sizes and checksums. If any rank finds
    the checkpoint damaged, all ranks raise, or, with ``--datastates-load-fallback``, all move on
    to the next older committed checkpoint together.
    """
    args = _get_args()
    load_dir = getattr(args, load_arg, None)
    if load_dir is None:
        return 0, 0
    committed = [m["version"] for _, m in list_committed(load_dir) if isinstance(m.get("version"), int)]
    iteration = read_tracker(load_dir)
    if iteration is None:
        if not committed:
            log.warning("[datastates] no committed checkpoint in %s: training starts from scratch", load_dir)
            return 0, 0
        iteration = committed[-1]
        log.warning("[datastates] %s is missing; using the newest committed checkpoint, iteration %d",
                    TRACKER, iteration)
    candidates = [iteration]
    if getattr(args, "datastates_load_fallback", False):
        candidates += sorted((v for v in committed if v < iteration), reverse=True)
    started = time.monotonic()
    for n, candidate in enumerate(candidates):
        error: BaseException | None = None
        try:
            *result, levels = _load_iteration(load_dir, candidate, ddp_model, optimizer, opt_param_scheduler, args,
                                     strict, skip_load_to_model_and_opt)
        except CheckpointError as exc:
            error = exc
        failed = torch.tensor([0 if error is None else 1])
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if not failed.item():
            log.warning("[datastates] loaded %s from %s (%s level) in %.2fs", checkpoint_name(candidate), load_dir,
                        levels, time.monotonic() - started)
            return tuple(result)
        reason = str(error) if error is not None else "damaged on another rank"
        if n + 1 < len(candidates):
            log.warning("[datastates] %s cannot be loaded (%s); falling back to %s", checkpoint_name(candidate),
                        reason, checkpoint_name(candidates[n + 1]))
            continue
        hint = "" if len(candidates) > 1 else " (--datastates-load-fallback loads the previous one instead)"
        raise CheckpointError(f"{checkpoint_name(candidate)} in {load_dir} cannot be loaded: {reason}{hint}") from error
    raise AssertionError("unreachable")


def _load_iteration(load_dir: str, iteration: int, ddp_model, optimizer, opt_param_scheduler, args,
                    strict: bool, skip_load_to_model_and_opt: bool) -> tuple[int, Any, str]:
    """Load one committed checkpoint into model, optimizer, scheduler and RNGs; also the levels read."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    model = _unwrap(ddp_model)
    engine = get_engine(args) if args.save else CheckpointEngine(
        {"save_dir": load_dir, "host_cache_size": 0.01, "safe_classes": list(megatron_safe_classes())}, read_only=True)
    ckpt = engine.open_checkpoint(checkpoint_name(iteration), root=load_dir)
    engine.agree_load_level(ckpt)  # every rank node-local, or every rank shared
    tensor_index, object_index = _index(ckpt.manifest)
    rank = torch.distributed.get_rank()
    zero_name = next(name for name, f in ckpt.manifest["files"].items() if f["rank"] == 0)
    meta = ckpt.reader(zero_name).part("meta")
    layout = _layout()
    saved_shards = _reshard_source(ckpt, meta["layout"], layout)  # None: same layout, exact shard ids

    common = ckpt.reader(zero_name).part("common")
    optimizer_format = (common.get("optimizer") or {}).get("param_state_sharding_type")
    with_optimizer = optimizer is not None and not getattr(args, "no_load_optim", False) and not getattr(args, "finetune", False)
    if with_optimizer and optimizer_format == DP_RESHARDABLE and saved_shards is not None:
        raise CheckpointError(f"{ckpt.checkpoint} holds the optimizer in bucket space (dp_reshardable), which loads "
                              "on the saved TP/PP/DP layout only")
    if with_optimizer:
        optimizer_state.ensure_state(optimizer)
    sharded, nonpersistent, factories = load_preprocess(_sharded_state(model, optimizer, with_optimizer,
                                                                       optimizer_format))
    sharded, _ = extract_sharded_base(sharded)  # the non-sharded values come from the saved "common"
    missing: list[str] = []
    prefetched = {} if saved_shards is not None else _read_own_shards(ckpt, tensor_index, sharded)

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, (ShardedTensor, ShardedObject)):
            return leaf
        sid = sharding.shard_id(leaf)
        if isinstance(leaf, ShardedObject):
            if sid not in object_index:
                missing.append(sid)
                return None
            return ckpt.reader(object_index[sid]).part("shards", "objects", sid)
        if saved_shards is not None:
            return _assemble(saved_shards, leaf)
        if sid not in prefetched:
            missing.append(sid)
            return None
        tensor = prefetched[sid]
        expected = tuple(leaf.data.shape) if leaf.data is not None else tuple(leaf.local_shape)
        if tuple(tensor.shape) != expected:
            # A shard converted from torch_dist keeps megatron-core's prepended axes of size 1.
            if [n for n in tensor.shape if n != 1] != [n for n in expected if n != 1]:
                raise CheckpointError(f"shard {sid}: checkpoint has shape {tuple(tensor.shape)}, the model {expected}")
            tensor = tensor.view(expected)
        return tensor

    dict_list_map_inplace(fill, sharded)
    if missing:
        raise CheckpointError(f"{len(missing)} shard(s) needed by this rank are not in the checkpoint, e.g. "
                              f"{missing[:3]}; was it saved from a different model or parallel layout?")
    merge(common, nonpersistent)
    merge(common, sharded)
    state = apply_factory_merges(common, factories)

    if not skip_load_to_model_and_opt:
        for key, chunk in zip(_model_keys(model), model):
            chunk.load_state_dict(state[key], strict=strict)
        if with_optimizer and optimizer_format == DP_RESHARDABLE:
            optimizer.load_state_dict(state["optimizer"])
            optimizer_state.restore_adam_steps(optimizer)
        elif with_optimizer:
            optimizer_state.check_param_groups(optimizer, state["optimizer"])
            optimizer_state.load_model_space_state_dict(optimizer, state["optimizer"])
    if opt_param_scheduler is not None and meta.get("scheduler") is not None and not getattr(args, "finetune", False):
        opt_param_scheduler.load_state_dict(meta["scheduler"])
    own = next((n for n, f in ckpt.manifest["files"].items() if f["rank"] == rank), None)
    if not getattr(args, "no_load_rng", False) and not getattr(args, "finetune", False):
        if saved_shards is not None:
            reseed_rngs(getattr(args, "seed", 1234), iteration, layout)
        elif own is not None:
            set_rng_state(ckpt.reader(own).part("rng"))
    saved_args = meta.get("args")
    for field in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples"):
        if saved_args is not None and hasattr(saved_args, field) and not getattr(args, "finetune", False):
            setattr(args, field, getattr(saved_args, field))
    levels = "/".join(sorted(ckpt.levels_used)) or "no"
    if getattr(args, "finetune", False):
        return 0, 0, levels
    return iteration, meta.get("num_floating_point_operations_so_far", 0), levels


def _read_own_shards(ckpt: Any, tensor_index: dict[str, tuple[str, str]], sharded: Any) -> dict[str, torch.Tensor]:
    """Every tensor shard this rank loads, by shard id: one batched parallel read per file."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    wanted: dict[str, dict[str, str]] = {}  # file -> tensor name -> shard id
    for leaf in nested_values(sharded):
        if isinstance(leaf, ShardedTensor):
            sid = sharding.shard_id(leaf)
            if sid in tensor_index:
                file_name, tensor_name = tensor_index[sid]
                wanted.setdefault(file_name, {})[tensor_name] = sid
    found: dict[str, torch.Tensor] = {}
    for file_name, names in wanted.items():
        for tensor_name, tensor in ckpt.reader(file_name).tensors(names).items():
            found[names[tensor_name]] = tensor
    return found


def _index(manifest: dict) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """Shard id -> (file, tensor name) for tensors and -> file for objects, over all ranks' files.

    ``manifest`` is validated (``read_manifest``); a shard id claimed twice is an error, never a
    silent choice between two files.
    """
    prefix = "shards/tensors/"
    tensors: dict[str, tuple[str, str]] = {}
    objects: dict[str, str] = {}
    for name, entry in manifest["files"].items():
        for tensor_name in entry["tensors"]:
            if tensor_name.startswith(prefix):
                sid = tensor_name[len(prefix):]
                if sid in tensors:
                    raise CheckpointError(f"{manifest['checkpoint']}: shard {sid!r} is in files {tensors[sid][0]!r} "
                                          f"and {name!r}")
                tensors[sid] = (name, tensor_name)
        extra = entry.get("extra") if entry.get("extra") is not None else {}
        listed = extra.get("objects", []) if isinstance(extra, dict) else None
        if type(listed) is not list or not all(type(sid) is str for sid in listed):
            raise CheckpointError(f"{manifest['checkpoint']}: file {name!r} has a malformed extra.objects list")
        for sid in listed:
            if sid in objects:
                raise CheckpointError(f"{manifest['checkpoint']}: object shard {sid!r} is in files {objects[sid]!r} "
                                      f"and {name!r}")
            objects[sid] = name
    return tensors, objects


def _reshard_source(ckpt: Any, saved: dict, current: dict) -> SavedShards | None:
    """The saved shards to assemble from when the parallel layout changed; None when it did not."""
    differ = [f"{k.upper()} {saved.get(k)} -> {current.get(k)}" for k in ("tp", "pp", "dp")
              if saved.get(k) != current.get(k)]
    if not differ:
        return None
    if torch.distributed.get_rank() == 0:
        log.warning("[datastates] resharding %s: parallel layout %s; every shard is assembled from the saved "
                    "ones that overlap it", ckpt.checkpoint, ", ".join(differ))
    return SavedShards(ckpt)


def _assemble(saved_shards: SavedShards, leaf: Any) -> torch.Tensor:
    """A ShardedTensor's data in this run's layout, from the saved shards of its key that overlap it."""
    if saved_shards.global_shape(leaf.key) != tuple(leaf.global_shape):
        raise CheckpointError(f"{leaf.key}: checkpoint has global shape {saved_shards.global_shape(leaf.key)}, "
                              f"the model {tuple(leaf.global_shape)}")
    return saved_shards.read_shard(leaf.key, leaf.global_offset, leaf.local_shape, leaf.prepend_axis_num,
                                   leaf.flattened_range)


def reseed_rngs(seed: int, iteration: int, layout: dict) -> None:
    """RNGs after a resharded load: a fresh, deterministic start for this rank and iteration.

    The saved per-rank RNG streams belong to ranks of the old layout (a tensor-parallel rank's
    dropout stream, a pipeline stage's), so none of them continues meaningfully on another layout.
    Every RNG is seeded as Megatron seeds a new run (``seed + 100 * pipeline rank``, the
    model-parallel tracker from that), shifted by the iteration so the streams differ from the
    first iterations'. The same checkpoint and layout always give the same streams.
    """
    from megatron.core import tensor_parallel

    mixed = (seed + 100 * layout["pp_rank"] + 1_000_003 * iteration) % (2**31)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
    tensor_parallel.model_parallel_cuda_manual_seed(mixed)
    if torch.distributed.get_rank() == 0:
        log.warning("[datastates] RNG states are not carried across layouts: reseeded every rank from seed %d and "
                    "iteration %d", seed, iteration)
