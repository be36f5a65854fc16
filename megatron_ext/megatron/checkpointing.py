"""Drop-in ``save_checkpoint`` / ``load_checkpoint`` for Megatron-LM, backed by the lazy engine.

The signatures are those of ``megatron/training/checkpointing.py`` at the pinned commit, so the
patch set only re-routes calls here, and the behaviour follows Megatron-LM's own functions
(docs/MEGATRON.md lists each of their behaviours and how this module matches it). The layout
stays Megatron's (``checkpoint_layout``: ``<save>/iter_0000123/`` per checkpoint and
``<save>/latest_checkpointed_iteration.txt``, which rank 0 writes (atomically) only once the
checkpoint is committed, i.e. every rank's bytes are durable), with one file per rank:

* ``shards``: the model and distributed-optimizer shards this rank owns (``sharding.py``), as
  zero-copy views, with their global placement; the optimizer's state is described per parameter
  (``optimizer_state.py``, model space): each data-parallel rank's slices of the fp32 main params
  and Adam moments are its own shards (no gather);
* ``rng``, ``rerun_state_machine`` and, on global rank 0, ``common`` and ``meta``, as
  ``checkpoint_layout`` lists them.

Loading into the same TP/PP/DP layout reads each shard by id; into another layout, each shard
is assembled from the saved shards that overlap it (``shard_assembly.py``). Before the model
state reaches ``load_state_dict``, Transformer Engine's pickled fp8 extra state is checked
(``te_extra_state.py``); before the optimizer state is read, its stored form is compared with the
optimizer's (``optimizer_state.check_stored_form``).

``save_checkpoint`` returns as soon as the engine has recorded the tensors; the copies overlap
with the next forward/backward, and ``install_lazy_wait`` makes the optimizer wait right before
its inner step (``step_with_ready_grads``), after gradient preparation and clipping.

A process's checkpointing state (its engine, the shard ownership plan, the args) lives in one
``MegatronCheckpointer``; the module-level functions Megatron-LM's patched
``megatron/training/checkpointing.py`` calls (``save_checkpoint``, ``load_checkpoint``,
``load_base_checkpoint_rank0``, ``finalize_checkpoints``) hand over to the process's instance.

Inside Megatron-LM (``megatron.training`` importable and the args are its own), the module also
does what only Megatron-LM's loop needs: argument checks against the checkpoint, the loaded
iteration, the number of micro-batches, the rerun state machine and the data loader's state.
Checkpoints in Megatron-LM's own formats (a ``torch_dist`` checkpoint to resume or fine-tune
from) and ``--ckpt-convert-format`` are handed to Megatron-LM's own functions.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, Callable

import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed
from megatron_ext.engine.collectives import all_reduce_int
from megatron_ext.engine.format.catalog import read_manifest
from megatron_ext.engine.format.names import MANIFEST
from megatron_ext.engine.format.safetensors import torch_dtype
from megatron_ext.megatron import optimizer_state, param_gather, sharding, te_extra_state
from megatron_ext.megatron.args import MegatronAdapterOptions, engine_config_from_args
from megatron_ext.megatron.checkpoint_layout import (
    CHECKPOINT_VERSION,
    COMMON,
    NON_PERSISTENT_SUBDIR,
    RELEASE,
    RERUN_STATE,
    RNG,
    TRACKER_FILE,
    capture_rng_state,
    checkpoint_dir,
    checkpoint_name,
    file_of_rank,
    is_datastates_checkpoint,
    is_megatron_lm_format,
    rank_extra,
    rank_file_name,
    rank_state,
    read_run_meta,
    read_tracker,
    restore_rng_state,
    run_meta,
    tracker_writer,
)
from megatron_ext.megatron.host_cache_size import AUTO, auto_host_cache, checkpoint_rank_bytes, tensor_bytes
from megatron_ext.megatron.safe_classes import megatron_safe_classes
from megatron_ext.megatron.shard_assembly import SavedShards

log = logging.getLogger("megatron_ext.megatron")

DP_RESHARDABLE = "dp_reshardable"
DP_ZERO = "dp_zero_gather_scatter"
#: megatron-core's own optimizer formats (checkpoints converted from torch_dist): megatron-core builds
#: the state dict to load into, on the saved layout.
NATIVE_FORMATS = (DP_RESHARDABLE, DP_ZERO)
READER_CACHE_GB = 1 / 1024  # a load's own engine: rounded up to one chunk (staging for O_DIRECT reads)


def _engine_config(args: Any) -> dict:
    """The engine configuration of ``args``, Megatron's classes added to the allow-list."""
    cfg = engine_config_from_args(args)
    cfg["safe_classes"] = list(megatron_safe_classes()) + list(cfg.get("safe_classes") or [])
    return cfg


class MegatronCheckpointer:
    """One process's Megatron-LM checkpointing: its engine, shard ownership plan and args.

    The engine is created at the first save, or right after a load (its host cache then
    allocates in the background) and its configuration is fixed from then on; the ownership plan
    is made at the first save and again whenever the set of shards changes.
    """

    def __init__(self) -> None:
        self.args: Any = None  # set_args(), for trainers without ``megatron.training``
        self.engine: CheckpointEngine | None = None
        self.plan: sharding.OwnershipPlan | None = None
        self._engine_key: tuple | None = None
        # This rank's bytes in the checkpoint last loaded, and whence: an ``auto`` host cache's size.
        self._loaded_bytes: tuple[int | None, str] = (None, "")

    # ------------------------------------------------------------------------ configuration
    def get_args(self) -> Any:
        if self.args is not None:
            return self.args
        try:
            from megatron.training import get_args  # present in a Megatron-LM checkout only
        except ImportError as exc:
            raise RuntimeError("megatron_ext.megatron.checkpointing.set_args(args) was not called") from exc
        return get_args()

    def megatron_lm(self) -> Any:
        """Megatron-LM's own ``megatron.training.checkpointing`` when its training loop is the caller, else None."""
        if self.args is not None:
            return None
        from megatron.training import checkpointing as native

        return native

    def get_engine(self, args: Any | None = None, rank_bytes: int | None = None,
                   bytes_source: str = "") -> CheckpointEngine:
        """The process's engine, created on first use (its host cache then allocates in the background).

        With ``--datastates-host-cache-size auto`` (the default) its creation needs ``rank_bytes``,
        this rank's checkpoint bytes (``bytes_source`` says whence, for the log line).
        """
        args = args or self.get_args()
        cfg = _engine_config(args)
        key = tuple(sorted((k, str(v)) for k, v in cfg.items()))
        if self.engine is None:
            if cfg["host_cache_size"] == AUTO:
                if rank_bytes is None:
                    raise CheckpointError("--datastates-host-cache-size auto sizes the host cache from this rank's "
                                          "checkpoint bytes, which are not known yet; pass a size in GB")
                sizing = auto_host_cache(rank_bytes, cfg, bytes_source)
                cfg["host_cache_size"] = sizing.gb
                log.info("%s", sizing.log_line())
            self.engine = CheckpointEngine(cfg)
            self._engine_key = key
        elif key != self._engine_key:
            raise CheckpointError("the datastates configuration changed during the run; it is fixed at the first save")
        return self.engine

    def ownership(self, shards: list) -> sharding.OwnershipPlan:
        """Who writes which shard: planned at the first save with one all-gather over the data-parallel group.

        Planned again (the same collective) when the set of shards changes, which happens on every
        rank at the same save: the optimizer's first step adds its moments (fp16 runs skip their
        first steps, saved before that).
        """
        signature = sharding.candidate_signature(shards)
        if self.plan is None or self.plan.signature != signature:
            layout = _parallel_layout()
            if self.plan is not None:
                log.info("[datastates] the sharded state changed (%d -> %d shards): planning ownership again",
                         len(self.plan.signature), len(signature))
            self.plan = sharding.plan_ownership(shards, layout["dp_rank"], layout["dp"], _dp_gather())
            log.info("[datastates] shard ownership: bytes per data-parallel rank %s", self.plan.bytes_by_dp_rank)
        return self.plan

    # ------------------------------------------------------------------------ save
    def save(self, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
             checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
             pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
             train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
             tp_group=None, pp_group=None, dp_cp_group=None):
        """``save_checkpoint``."""
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

        args = self.get_args()
        native = self.megatron_lm()
        chunks = model if isinstance(model, list) else [model]
        if native is not None and getattr(args, "ckpt_convert_format", None) is not None:
            # --ckpt-convert-format: Megatron-LM writes the loaded state in the format asked for,
            # from complete parameters (patch 0004 left the all-gathers to us).
            if param_gather.deferred_param_gather(args):
                param_gather.sync_missing(chunks)
            with _megatron_lm_formats(args):
                return native.save_checkpoint(
                    iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context, non_persistent_ckpt=non_persistent_ckpt,
                    train_data_iterator=train_data_iterator,
                    preprocess_common_state_dict_fn=preprocess_common_state_dict_fn, release=release,
                    tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group)
        started = time.monotonic()
        root = save_root(args, non_persistent_ckpt)
        gate = param_gather.gather_gate(args, chunks)  # copies wait for --overlap-param-gather's all-gathers
        model = _unwrap(model)
        if native is not None:  # Energon data loaders keep their own state (a no-op for Megatron's own)
            native.maybe_save_dataloader_state(train_data_iterator, iteration, getattr(args, "dataloader_save", None))
        with_optimizer = not getattr(args, "no_save_optim", False)
        sharded, common = save_preprocess(_sharded_state(model, optimizer, with_optimizer),
                                          validate_access_integrity=False)
        shards = list(sharding.sharded_leaves(sharded))
        _copy_buffers_now(shards, model)
        plan = self.ownership(shards)
        tensors, objects, meta = sharding.split_owned(shards, plan)
        rank = torch.distributed.get_rank()
        layout = _parallel_layout()
        rng = None if getattr(args, "no_save_rng", False) else capture_rng_state()
        rerun = _rerun_state(native, train_data_iterator)
        run = None
        if rank == 0:
            # As Megatron-LM: the scheduler goes with the optimizer (none with --no-save-optim).
            scheduler = (opt_param_scheduler.state_dict() if opt_param_scheduler is not None and with_optimizer
                         else None)
            run = run_meta(iteration, num_floating_point_operations_so_far, scheduler, args, layout)
        state = rank_state({"tensors": tensors, "objects": objects, "meta": meta}, rng, rerun,
                           common if rank == 0 else None, run)
        engine = self.get_engine(args, tensor_bytes(state) if self.engine is None else None,
                                 f"its first save, iteration {iteration}")
        install_lazy_wait(optimizer, engine, wait_after_step=bool(getattr(args, "qk_clip", False)))
        name = checkpoint_name(RELEASE if release else iteration)
        engine.save(state, name, rank_file_name(rank), root=root, version=iteration, extra=rank_extra(objects, layout),
                    gate=gate)
        engine.commit(name, root=root, on_committed=tracker_writer(root, RELEASE if release else iteration, rank),
                      keep_last=1 if non_persistent_ckpt else None)
        log.info("[datastates] iteration %d: %scheckpoint recorded in %.4fs (%d tensors, %d objects owned here)",
                 iteration, "non-persistent " if non_persistent_ckpt else "", time.monotonic() - started,
                 len(tensors), len(objects))

    def finalize(self, blocking: bool = False, terminate: bool = False) -> None:
        """``finalize_checkpoints``."""
        if self.engine is None:
            return
        if terminate:
            self.shutdown()
        elif blocking:
            self.engine.wait_persisted()
        else:
            self.engine.raise_if_failed()

    def shutdown(self) -> None:
        """Stop the engine's threads; the next save starts a new engine and plans ownership again."""
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.plan = None, None

    # ------------------------------------------------------------------------ load
    def load(self, ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
             checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None,
             pp_group=None, dp_cp_group=None):
        """``load_checkpoint``."""
        args = self.get_args()
        native = self.megatron_lm()
        options = MegatronAdapterOptions.from_args(args)
        load_dir = getattr(args, load_arg, None)
        pretrained = getattr(args, "pretrained_checkpoint", None)
        finetune_from_pretrained = pretrained is not None and (load_dir is None or read_tracker(load_dir) is None)
        if finetune_from_pretrained:  # as Megatron-LM: no checkpoint of this run yet, so fine-tune from that one
            log.warning("[datastates] no checkpoint in %s: fine-tuning from the pretrained checkpoint in %s",
                        load_dir, pretrained)
            load_dir = pretrained
        chosen = _choose(load_dir, args)
        if chosen is not None and native is not None and is_megatron_lm_format(checkpoint_dir(*chosen)):
            log.warning("[datastates] %s holds a checkpoint in Megatron-LM's own format: Megatron-LM loads it; "
                        "checkpoints saved from now on are datastates checkpoints", chosen[0])
            with _megatron_lm_formats(args):
                return native.load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg=load_arg,
                                              strict=strict, checkpointing_context=checkpointing_context,
                                              skip_load_to_model_and_opt=skip_load_to_model_and_opt,
                                              tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group)
        if finetune_from_pretrained:
            if chosen is None:
                raise FileNotFoundError("No checkpoint found in load directory or pretrained directory")
            args.finetune = True
        if native is not None:  # what Megatron-LM records in _load_base_checkpoint
            native.set_loaded_iteration(-1 if chosen is None else 0 if chosen[1] == RELEASE else chosen[1])
        if chosen is None:
            if getattr(args, "exit_on_missing_checkpoint", False):
                log.warning("[datastates] no checkpoint in %s and --exit-on-missing-checkpoint: exiting", load_dir)
                torch.distributed.barrier()
                sys.exit()
            log.warning("[datastates] no committed checkpoint in %s: training starts from scratch", load_dir)
            return 0, 0
        root, iteration = chosen
        candidates = [iteration]
        if options.load_fallback and iteration != RELEASE:
            committed = [m["version"] for _, m in list_committed(root) if isinstance(m.get("version"), int)]
            candidates += sorted((v for v in committed if v < iteration), reverse=True)
        started = time.monotonic()
        for n, candidate in enumerate(candidates):
            error: BaseException | None = None
            try:
                *result, levels = self._load_iteration(root, candidate, ddp_model, optimizer, opt_param_scheduler,
                                                       args, strict, skip_load_to_model_and_opt)
            except CheckpointError as exc:
                error = exc
            # On the world's device (CUDA under NCCL, which refuses host tensors): 0 loaded, 1 damaged,
            # 2 saved from another model (every older checkpoint of the run would be too).
            outcome = 0 if error is None else 2 if isinstance(error, ModelMismatch) else 1
            outcome = all_reduce_int(outcome, torch.distributed.ReduceOp.MAX)
            if not outcome:
                log.warning("[datastates] loaded %s from %s (%s level) in %.2fs: iteration %d",
                            checkpoint_name(candidate), root, levels, time.monotonic() - started, result[0])
                if getattr(args, "save", None):  # now, so its cache is ready before the first save's copies
                    self.get_engine(args, *self._loaded_bytes)
                return tuple(result)
            reason = str(error) if error is not None else "it fails on another rank"
            if outcome == 2:  # no older checkpoint of the same run fits this model better
                raise CheckpointError(f"{checkpoint_name(candidate)} in {root} does not fit this model: {reason}. "
                                      "Check the model and parallelism flags against the ones it was saved with "
                                      "(`megatron-ext inspect` shows its layout)") from error
            if n + 1 < len(candidates):
                log.warning("[datastates] %s cannot be loaded (%s); falling back to %s", checkpoint_name(candidate),
                            reason, checkpoint_name(candidates[n + 1]))
                continue
            hint = "" if len(candidates) > 1 else " (--datastates-load-fallback loads the previous one instead)"
            raise CheckpointError(f"{checkpoint_name(candidate)} in {root} cannot be loaded: {reason}{hint}") from error
        raise AssertionError("unreachable")

    def _load_engine(self, args: Any, load_dir: str, iteration: int | str) -> tuple[CheckpointEngine, bool]:
        """The engine that reads, and whether it is a reader of its own (shut down after the load).

        A read-only engine with the run's settings (node-local level, read threads, ``O_DIRECT``)
        and a host cache of one chunk. The run's engine starts after the load (``load``): its
        cache, which it touches in the background, would otherwise take the cores and memory
        bandwidth the reads need (on 2 CPU ranks, 1.45 s against 1.09 s per load). The run's
        engine reads itself when it exists already, or with peer replicas, whose recovery is a
        collective of the run's engine (its ``auto`` host cache sized from the manifest it loads).
        """
        if self.engine is None and getattr(args, "save", None) and getattr(args, "datastates_peer_replica", False):
            manifest = read_manifest(checkpoint_dir(load_dir, iteration))
            if manifest is not None:
                self._loaded_bytes = _rank_bytes(manifest, checkpoint_name(iteration))
            return self.get_engine(args, *self._loaded_bytes), False
        if self.engine is not None:
            return self.get_engine(args), False
        cfg = _engine_config(args)
        cfg.update(save_dir=load_dir, host_cache_size=READER_CACHE_GB)
        return CheckpointEngine(cfg, read_only=True), True

    def _load_iteration(self, load_dir: str, iteration: int | str, ddp_model, optimizer, opt_param_scheduler, args,
                        strict: bool, skip_load_to_model_and_opt: bool) -> tuple[int, Any, str]:
        """Load one committed checkpoint as Megatron-LM's ``load_checkpoint`` does; also the levels read.

        Which parts are loaded follows Megatron-LM: the optimizer and the scheduler unless
        ``--no-load-optim``, ``--finetune`` or a release checkpoint (otherwise the fp32 main params
        are refreshed from the loaded weights); RNGs unless ``--no-load-rng``, ``--finetune``, a
        release, or another TP/PP layout; the rerun state machine only on the same world and layout.
        """
        engine, reader_only = self._load_engine(args, load_dir, iteration)
        try:
            return self._load_from(engine, load_dir, iteration, ddp_model, optimizer, opt_param_scheduler, args,
                                   strict, skip_load_to_model_and_opt)
        finally:
            if reader_only:
                engine.shutdown()

    def _load_from(self, engine: CheckpointEngine, load_dir: str, iteration: int | str, ddp_model, optimizer,
                   opt_param_scheduler, args, strict: bool, skip_load_to_model_and_opt: bool) -> tuple[int, Any, str]:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        native = self.megatron_lm()
        model = _unwrap(ddp_model)
        ckpt = engine.open_checkpoint(checkpoint_name(iteration), root=load_dir)
        self._loaded_bytes = _rank_bytes(ckpt.manifest, ckpt.checkpoint)
        engine.agree_load_level(ckpt)  # every rank node-local, or every rank shared
        tensor_index, object_index = _index(ckpt.manifest, ckpt.index)
        rank = torch.distributed.get_rank()
        zero_name = file_of_rank(ckpt.manifest, 0)
        if zero_name is None:
            raise CheckpointError(f"{ckpt.checkpoint} has no file of rank 0 (its common state and args)")
        meta = read_run_meta(ckpt.reader(zero_name))
        saved_args = meta.get("args")
        layout = _parallel_layout()
        saved_layout = meta["layout"]
        saved_shards = _reshard_source(ckpt, saved_layout, layout)  # None: same layout, exact shard ids
        release = iteration == RELEASE
        finetune = bool(getattr(args, "finetune", False))
        if native is not None:
            native.set_checkpoint_version(meta.get("checkpoint_version", CHECKPOINT_VERSION))
        if saved_args is not None and not finetune:  # before any weight is read: a wrong shape fails with its name
            _carry_args(native, args, saved_args)

        common = ckpt.reader(zero_name).part(COMMON)
        optimizer_format = _optimizer_format(common.get("optimizer"))
        with_optimizer = (optimizer is not None and not release and not finetune
                          and not getattr(args, "no_load_optim", False))
        if with_optimizer and "optimizer" not in common:
            raise CheckpointError(f"{ckpt.checkpoint} holds no optimizer state (saved with --no-save-optim); "
                                  "pass --no-load-optim or --finetune to load it without")
        if with_optimizer and optimizer_format in NATIVE_FORMATS and saved_shards is not None:
            raise CheckpointError(f"{ckpt.checkpoint} holds the optimizer in megatron-core's {optimizer_format} format "
                                  "(converted from torch_dist), which loads on the saved TP/PP/DP layout only; "
                                  "torch_dist checkpoints in fully_reshardable convert to a reshardable one")
        if with_optimizer and optimizer_format not in NATIVE_FORMATS:  # before anything is read or allocated
            optimizer_state.check_stored_form(optimizer, common.get("optimizer"), checkpoint=ckpt.checkpoint,
                                              resharding=saved_shards is not None)
        if with_optimizer and not optimizer_state.saved_before_first_step(common.get("optimizer")):
            optimizer_state.allocate_state(optimizer)  # every value is read into it below; else main params only
        sharded, nonpersistent, factories = load_preprocess(_sharded_state(model, optimizer, with_optimizer,
                                                                           optimizer_format, is_loading=True))
        sharded, _ = extract_sharded_base(sharded)  # the non-sharded values come from the saved "common"
        missing: list[str] = []
        prefetched = {} if saved_shards is not None else _read_own_shards(ckpt, tensor_index, sharded)
        object_sources: dict[int, str] = {}  # id of a loaded object -> its file and shard id
        # Converted from fully_reshardable: the optimizer's boxes are whole, each rank's slices are cut from them.
        boxes = (saved_shards or SavedShards(ckpt)) if with_optimizer and optimizer_state.whole_boxes(
            common.get("optimizer")) else None

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
            tensor = _same_kind(sid, prefetched[sid], leaf)
            expected = tuple(leaf.data.shape) if leaf.data is not None else tuple(leaf.local_shape)
            if tuple(tensor.shape) != expected:
                # A shard converted from torch_dist keeps megatron-core's prepended axes of size 1.
                if [n for n in tensor.shape if n != 1] != [n for n in expected if n != 1]:
                    raise ModelMismatch(f"shard {sid}: checkpoint has shape {tuple(tensor.shape)}, "
                                          f"the model {expected}")
                tensor = tensor.view(expected)
            return tensor

        dict_list_map_inplace(fill, sharded)
        if missing:
            raise ModelMismatch(f"{len(missing)} shard(s) needed by this rank are not in the checkpoint, e.g. "
                                  f"{missing[:3]}; was it saved from a different model or parallel layout?")
        merge(common, nonpersistent)
        merge(common, sharded)
        state = apply_factory_merges(common, factories)

        loaded_iteration = 0 if finetune or release else meta["iteration"]
        if not skip_load_to_model_and_opt:
            # Transformer Engine unpickles its fp8 extra state in load_state_dict: checked first, every chunk.
            allow_pickle = MegatronAdapterOptions.from_args(args).allow_pickle
            for key in _model_keys(model):
                te_extra_state.check_extra_state(
                    state[key], allow_pickle=allow_pickle,
                    where=lambda _, value: object_sources.get(id(value), f"{ckpt.checkpoint} in {load_dir}"))
            for key, chunk in zip(_model_keys(model), model):
                _load_model_chunk(chunk, state[key], strict)
        if with_optimizer:
            if not skip_load_to_model_and_opt:
                if optimizer_format in NATIVE_FORMATS:
                    with optimizer_state.steps_set_aside(optimizer):
                        optimizer.load_state_dict(state["optimizer"])
                    # --optimizer-cpu-offload: megatron-core's dp_reshardable and dp_zero_gather_scatter
                    # readers set HDO.state without handing it to the sub-optimizers.
                    optimizer_state.sync_hybrid(optimizer)
                    optimizer_state.restore_adam_steps(optimizer)
                else:
                    optimizer_state.check_param_groups(optimizer, state["optimizer"])
                    optimizer_state.load_model_space_state_dict(optimizer, state["optimizer"])
            if opt_param_scheduler is not None and meta.get("scheduler") is not None:
                opt_param_scheduler.load_state_dict(meta["scheduler"])
        elif optimizer is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
            optimizer.reload_model_params()  # the fp32 main params start from the loaded weights
        same_run_layout = all(saved_layout.get(k) == layout[k] for k in ("world_size", "tp", "pp", "dp"))
        if native is not None and same_run_layout and not release and not finetune:
            _load_rerun_state(ckpt, rank)
        if not release and not finetune and not getattr(args, "no_load_rng", False):
            _load_rngs(ckpt, saved_args, saved_layout, layout, args)
        if optimizer is not None:  # as Megatron-LM, for optimizers of checkpoints that predate the field
            for group in optimizer.param_groups:
                group.setdefault("default_config", True)
        # No barrier here: the caller's all-reduce of every rank's outcome is the synchronisation
        # point, and a rank that failed is already waiting in it.
        levels = "/".join(sorted(ckpt.levels_used)) or "no"
        return loaded_iteration, meta.get("num_floating_point_operations_so_far", 0), levels


class ModelMismatch(CheckpointError):
    """The checkpoint is intact but was saved from another model (shapes, keys): not a damaged one."""


# ---------------------------------------------------------------------------- the entry points Megatron-LM calls
_CHECKPOINTER = MegatronCheckpointer()


def checkpointer() -> MegatronCheckpointer:
    """This process's ``MegatronCheckpointer`` (the one the module-level functions use)."""
    return _CHECKPOINTER


def set_args(args: Any) -> None:
    """For trainers without ``megatron.training`` (the PyPI megatron-core has none)."""
    _CHECKPOINTER.args = args


def get_engine(args: Any | None = None, rank_bytes: int | None = None, bytes_source: str = "") -> CheckpointEngine:
    """The process's engine, created on first use (its host cache then allocates in the background).

    Creating it with an ``auto`` host cache (the default) needs ``rank_bytes``, this rank's
    checkpoint bytes; ``save_checkpoint`` and ``load_checkpoint`` create it themselves.
    """
    return _CHECKPOINTER.get_engine(args, rank_bytes, bytes_source)


def current_engine() -> CheckpointEngine | None:
    return _CHECKPOINTER.engine


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
                    tp_group=None, pp_group=None, dp_cp_group=None):
    """Record iteration ``iteration``'s state and return; flush and commit happen in the background.

    ``preprocess_common_state_dict_fn`` feeds only torch_dist's check that every rank holds the
    same common state; here one copy of it (global rank 0's) is saved, so it is not called.
    Saving an iteration that was already saved in this run (Megatron-LM does on a batch-size
    ramp-up step and for its rerun state machine) replaces that checkpoint, as in Megatron-LM.
    """
    return _CHECKPOINTER.save(
        iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
        checkpointing_context=checkpointing_context, pipeline_rank=pipeline_rank, expert_rank=expert_rank,
        tensor_rank=tensor_rank, pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel,
        non_persistent_ckpt=non_persistent_ckpt, train_data_iterator=train_data_iterator,
        preprocess_common_state_dict_fn=preprocess_common_state_dict_fn, release=release,
        tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None,
                    pp_group=None, dp_cp_group=None):
    """Load the checkpoint Megatron-LM would load; returns ``(iteration, num_floating_point_operations_so_far)``.

    Every file read is checked against the manifest's sizes and checksums. If any rank finds
    the checkpoint damaged, all ranks raise, or, with ``--datastates-load-fallback``, all move on
    to the next older committed checkpoint together. A checkpoint Megatron-LM wrote in its own
    format is loaded by Megatron-LM's own ``load_checkpoint``.
    """
    return _CHECKPOINTER.load(ddp_model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict,
                              checkpointing_context=checkpointing_context,
                              skip_load_to_model_and_opt=skip_load_to_model_and_opt, tp_group=tp_group,
                              pp_group=pp_group, dp_cp_group=dp_cp_group)


def finalize_checkpoints(blocking: bool = False, terminate: bool = False) -> None:
    """Megatron's ``maybe_finalize_async_save`` hook, called every iteration and at the end.

    Non-blocking calls surface background failures on the training thread; blocking ones wait
    until every pending checkpoint is committed (end of training, exit signal); ``terminate``
    also stops the engine's threads.
    """
    _CHECKPOINTER.finalize(blocking=blocking, terminate=terminate)


def shutdown() -> None:
    _CHECKPOINTER.shutdown()


def load_base_checkpoint_rank0(load_dir: str | None, args: Any) -> tuple[dict | None, str, bool, None]:
    """Megatron-LM's ``_load_base_checkpoint(rank0=True)``: args and iteration, before distributed start-up.

    ``--use-checkpoint-args`` reads the saved args through it. Only rank 0's ``meta`` is read
    (no process group exists yet); its checksums are verified.
    """
    from megatron_ext.megatron.export import open_iteration, saved_meta

    chosen = _choose(load_dir, args)
    if chosen is None:
        return None, "", False, None
    root, iteration = chosen
    directory = checkpoint_dir(root, iteration)
    if not is_datastates_checkpoint(directory):
        raise CheckpointError(f"{directory} is not a committed datastates checkpoint (no {MANIFEST}); "
                              "--use-checkpoint-args with --use-datastates reads datastates checkpoints only")
    meta = saved_meta(open_iteration(root, iteration))
    state = {"args": meta.get("args"), "iteration": meta["iteration"],
             "checkpoint_version": meta.get("checkpoint_version", CHECKPOINT_VERSION)}
    return state, directory, iteration == RELEASE, None


# ---------------------------------------------------------------------------- save helpers
def install_lazy_wait(optimizer: Any, engine: CheckpointEngine, wait_after_step: bool = False) -> None:
    """Make ``optimizer.step_with_ready_grads`` wait for pending snapshots first (idempotent).

    ``wait_after_step``: also wait when ``step`` returns, for code that edits the saved weights
    after the optimizer step even when the step itself was skipped (``--qk-clip``).
    """
    if optimizer is None or getattr(optimizer, "_datastates_lazy_wait", False):
        return
    inner_step = optimizer.step_with_ready_grads

    def step_with_ready_grads(*args: Any, **kwargs: Any):
        engine.wait_snapshot()
        return inner_step(*args, **kwargs)

    optimizer.step_with_ready_grads = step_with_ready_grads
    if wait_after_step:
        outer_step = optimizer.step

        def step(*args: Any, **kwargs: Any):
            result = outer_step(*args, **kwargs)
            engine.wait_snapshot()  # a no-op when the inner step already waited
            return result

        optimizer.step = step
    optimizer._datastates_lazy_wait = True


def _copy_buffers_now(shards: list, model: list) -> None:
    """Copy, at the save, every shard that lives in a module buffer rather than a parameter.

    The lazy snapshot may read a tensor until the next optimizer step, which is the first thing
    to write parameters. Buffers are written elsewhere: ``--moe-router-enable-expert-bias``
    updates the routers' ``expert_bias`` in ``finalize_model_grads``, before that step, so a lazy
    copy of it could hold the next iteration's value. Buffers are small (one value per expert).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    storages = {b.untyped_storage().data_ptr() for chunk in model for b in chunk.buffers() if b.numel()}
    for shard in shards:
        data = shard.data if isinstance(shard, ShardedTensor) else None
        if isinstance(data, torch.Tensor) and data.numel() and data.untyped_storage().data_ptr() in storages:
            shard.data = data.clone()


def _unwrap(model: Any) -> list:
    """The bare model chunks (no DDP or Float16Module wrappers), as Megatron-LM saves them."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model if isinstance(model, list) else [model])


def _model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _model_metadata() -> dict:
    """The content metadata Megatron-LM hands to ``sharded_state_dict`` (it decides the shard keys)."""
    from megatron.core import parallel_state as ps

    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _sharded_state(model: list, optimizer: Any, with_optimizer: bool, optimizer_format: str | None = None,
                   is_loading: bool = False) -> dict:
    """The sharded state dict saved (model-space optimizer) or to load into (the checkpoint's optimizer format).

    megatron-core's own formats (``NATIVE_FORMATS``: bucket-space ``dp_reshardable`` and the gathered
    ``dp_zero_gather_scatter``, which checkpoints converted from torch_dist carry, and
    ``dp_reshardable`` those saved before the model-space format) are built by megatron-core.
    """
    metadata = _model_metadata()
    sharded = {key: chunk.sharded_state_dict(metadata=metadata) for key, chunk in zip(_model_keys(model), model)}
    if with_optimizer and optimizer is not None:
        if optimizer_format in NATIVE_FORMATS:
            sharded["optimizer"] = optimizer.sharded_state_dict(
                sharded, is_loading=True, metadata={**metadata, "distrib_optim_sharding_type": optimizer_format})
        else:
            sharded["optimizer"] = optimizer_state.model_space_state_dict(optimizer, sharded, is_loading)
    return sharded


def _optimizer_format(saved: Any) -> str | None:
    """The optimizer format of a checkpoint's common ``optimizer`` state (chained optimizers: all the same)."""
    states = [saved] if isinstance(saved, dict) and "param_state_sharding_type" in saved else \
        [v for v in (saved or {}).values() if isinstance(v, dict)] if isinstance(saved, dict) else []
    kinds = {s.get("param_state_sharding_type") for s in states if "param_state_sharding_type" in s}
    if len(kinds) > 1:
        raise CheckpointError(f"the chained optimizers were saved in different formats: {sorted(map(str, kinds))}")
    return kinds.pop() if kinds else None


def _parallel_layout() -> dict:
    """This rank's place in the TP/PP/DP layout (the ``layout`` a checkpoint records)."""
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


def _rerun_state(native: Any, data_iterator: Any) -> dict | None:
    """This rank's state of Megatron-LM's rerun state machine, when it asks for a checkpoint; else None.

    Megatron-LM keeps its rank-level part in a ShardedObject of the world; here each rank's file
    holds its own part, so the object's data is stored in its place.
    """
    if native is None:
        return None
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    state = get_rerun_state_machine().state_dict(data_iterator=data_iterator, ckpt_format="torch_dist")
    if state is None:
        return None
    return {k: (v.data if isinstance(v, ShardedObject) else v) for k, v in state.items()}


def save_root(args: Any, non_persistent: bool) -> str:
    """Where a checkpoint goes: ``--save``, or for a non-persistent one Megatron-LM's global directory."""
    if not non_persistent:
        return args.save
    if getattr(args, "non_persistent_ckpt_type", None) != "global":
        raise CheckpointError(f"non-persistent checkpoint of type {getattr(args, 'non_persistent_ckpt_type', None)}: "
                              "--use-datastates writes 'global' ones (its node-local level is --datastates-local-dir)")
    return getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(args.save, NON_PERSISTENT_SUBDIR)


class _megatron_lm_formats:
    """Within the block Megatron-LM's own checkpoint functions take their native path (flag off)."""

    def __init__(self, args: Any):
        self.args = args

    def __enter__(self) -> None:
        self.args.use_datastates = False

    def __exit__(self, *exc: Any) -> None:
        self.args.use_datastates = True


# ---------------------------------------------------------------------------- load helpers
def _choose(load_dir: str | None, args: Any) -> tuple[str, int | str] | None:
    """The checkpoint Megatron-LM would load from ``load_dir``: ``(root, iteration or RELEASE)`` or None.

    As ``_load_base_checkpoint``: a non-persistent checkpoint at least as new as the persistent
    one wins; ``--ckpt-step`` overrides the tracker. Where the tracker is missing but committed
    checkpoints exist (a crash between the commit and the tracker's update), the newest committed
    one is taken, with a warning.
    """
    if load_dir is None:
        return None
    iteration = read_tracker(load_dir)
    if iteration is None:
        committed = [m["version"] for _, m in list_committed(load_dir) if isinstance(m.get("version"), int)]
        if committed:
            iteration = committed[-1]
            log.warning("[datastates] %s is missing in %s; using the newest committed checkpoint, iteration %d",
                        TRACKER_FILE, load_dir, iteration)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    if getattr(args, "non_persistent_ckpt_type", None) == "global":
        np_root = save_root(args, non_persistent=True) if getattr(args, "save", None) else (
            getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(load_dir, NON_PERSISTENT_SUBDIR))
        np_iteration = read_tracker(np_root)
        if np_iteration == RELEASE:
            raise CheckpointError(f"{os.path.join(np_root, TRACKER_FILE)}: a non-persistent checkpoint cannot be a "
                                  "release")
        if np_iteration is not None and (iteration is None or iteration == RELEASE or np_iteration >= iteration):
            log.warning("[datastates] loading the non-persistent checkpoint of iteration %d from %s", np_iteration,
                        np_root)
            return np_root, np_iteration
    return (load_dir, iteration) if iteration is not None else None


def _carry_args(native: Any, args: Any, saved_args: Any) -> None:
    """The saved run's progress counters, and (inside Megatron-LM) its argument checks."""
    if native is not None:
        native.check_checkpoint_args(saved_args)
    for field in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(args, field, getattr(saved_args, field, 0))
    if native is not None:
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)


def _load_model_chunk(chunk: Any, state: dict, strict: bool) -> None:
    """``load_state_dict``; as Megatron-LM, a strict load that fails is retried non-strictly (and said)."""
    try:
        chunk.load_state_dict(state, strict=strict)
    except Exception as exc:
        if not strict:
            raise
        result = chunk.load_state_dict(state, strict=False)
        log.warning("[datastates] strict model load failed (%s); loaded non-strictly: %s", exc, result)


def _load_rerun_state(ckpt: Any, rank: int) -> None:
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    own = file_of_rank(ckpt.manifest, rank)
    if own is None:
        return
    reader = ckpt.reader(own)
    if not reader.has_part(RERUN_STATE):
        return
    saved = reader.part(RERUN_STATE)
    machine = get_rerun_state_machine()
    if machine.validate_state_dict(saved):
        machine.load_state_dict(saved)


def _load_rngs(ckpt: Any, saved_args: Any, saved: dict, current: dict, args: Any) -> None:
    """RNG states as Megatron-LM restores them.

    Only on the saved tensor- and pipeline-parallel layout (otherwise the RNGs stay as they are,
    as in Megatron-LM); each rank takes the state of the saved rank at its (pipeline, tensor)
    coordinate and data-parallel rank 0, or its own data-parallel rank with
    ``--data-parallel-random-init``. On the same layout that is the rank's own state whenever the
    data-parallel ranks' streams agree, which they do unless seeded apart.
    """
    if saved_args is not None and getattr(saved_args, "no_save_rng", False):
        return
    if (saved.get("tp"), saved.get("pp")) != (current["tp"], current["pp"]):
        if torch.distributed.get_rank() == 0:
            log.warning("[datastates] (TP, PP) changed from %s to %s: RNG states are not loaded, as in Megatron-LM",
                        (saved.get("tp"), saved.get("pp")), (current["tp"], current["pp"]))
        return
    if all(saved.get(k) == current[k] for k in ("tp", "pp", "dp")):
        source = torch.distributed.get_rank()  # its own state (equal to DP rank 0's unless seeded apart)
    else:
        dp_rank = current["dp_rank"] if getattr(args, "data_parallel_random_init", False) else 0
        if dp_rank >= saved["dp"]:
            raise CheckpointError(f"--data-parallel-random-init: data-parallel rank {dp_rank} has no saved RNG state "
                                  f"(the checkpoint has {saved['dp']} data-parallel ranks)")
        source = next((f["rank"] for f in ckpt.manifest["files"].values()
                       if (f.get("extra") or {}).get("layout", {}).get("tp_rank") == current["tp_rank"]
                       and f["extra"]["layout"].get("pp_rank") == current["pp_rank"]
                       and f["extra"]["layout"].get("dp_rank") == dp_rank), None)
    own = file_of_rank(ckpt.manifest, source)
    if own is None:
        raise CheckpointError(f"{ckpt.checkpoint} has no RNG state for tensor rank {current['tp_rank']} and "
                              f"pipeline rank {current['pp_rank']}")
    restore_rng_state(ckpt.reader(own).part(RNG))


def _read_own_shards(ckpt: Any, tensor_index: dict[str, tuple[str, str]], sharded: Any) -> dict[str, torch.Tensor]:
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
                target = _live_target(ckpt.index.tensors(file_name)[tensor_name], leaf.data)
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


def _live_target(meta: dict, data: Any) -> torch.Tensor | None:
    """``data`` shaped as the saved tensor when the saved bytes can be read straight into it, else None."""
    if not isinstance(data, torch.Tensor) or not data.is_contiguous() or data.dtype != torch_dtype(meta["dtype"]):
        return None
    if data.numel() != math.prod(meta["shape"]) or data.numel() == 0:
        return None
    return data.view(meta["shape"])


def _index(manifest: dict, tensor_index: Any) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """Shard id -> (file, tensor name) for tensors and -> file for objects, over all ranks' files.

    ``manifest`` is validated (``read_manifest``), ``tensor_index`` its ``TensorIndex``; a shard id
    claimed twice is an error, never a silent choice between two files.
    """
    prefix = "shards/tensors/"
    tensors: dict[str, tuple[str, str]] = {}
    objects: dict[str, str] = {}
    for name, entry in manifest["files"].items():
        for tensor_name in tensor_index.tensors(name):
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


def _rank_bytes(manifest: dict, checkpoint: str) -> tuple[int, str]:
    """This rank's bytes in a committed checkpoint (``checkpoint_rank_bytes``), and whence, for ``get_engine``."""
    world = torch.distributed.get_world_size()
    same = manifest.get("world_size") == world
    return (checkpoint_rank_bytes(manifest, torch.distributed.get_rank(), world),
            f"its file in the loaded {checkpoint}" if same else
            f"estimated from the loaded {checkpoint}, saved by {manifest.get('world_size')} ranks")


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
        raise ModelMismatch(f"{leaf.key}: checkpoint has global shape {saved_shards.global_shape(leaf.key)}, "
                              f"the model {tuple(leaf.global_shape)}")
    return saved_shards.read_shard(leaf.key, leaf.global_offset, leaf.local_shape, leaf.prepend_axis_num,
                                   leaf.flattened_range)
