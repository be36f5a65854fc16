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
optimizer's (``optimizer_forms.check_stored_form``).

``save_checkpoint`` returns as soon as the engine has recorded the tensors; the copies overlap
with the next forward/backward, and ``install_lazy_wait`` makes the optimizer wait right before
its inner step (``step_with_ready_grads``), after gradient preparation and clipping.

A process's checkpointing state (its engine, the shard ownership plan, the args) lives in one
``MegatronCheckpointer``; the module-level functions Megatron-LM's patched
``megatron/training/checkpointing.py`` calls (``save_checkpoint``, ``load_checkpoint``,
``load_base_checkpoint_rank0``, ``finalize_checkpoints``) hand over to the process's instance.
This module holds those entry points, the save and its end; the load is ``loading.py`` (the
saved run's args, RNGs and rerun state ``saved_run.py``, the shard reads ``shard_reads.py``), and
what both ask of megatron-core ``core_state.py``.

Inside Megatron-LM (``megatron.training`` importable and the args are its own), the module also
does what only Megatron-LM's loop needs: argument checks against the checkpoint, the loaded
iteration, the number of micro-batches, the rerun state machine and the data loader's state.
Checkpoints in Megatron-LM's own formats (a ``torch_dist`` checkpoint to resume or fine-tune
from) and ``--ckpt-convert-format`` are handed to Megatron-LM's own functions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, Frozen
from megatron_ext.engine.errors import ConfigError
from megatron_ext.megatron import (core_state, fault_tolerance, model_state, optimizer_state, param_gather, saved_run,
                                  sharding)
from megatron_ext.megatron.args import adapter_engine_config
from megatron_ext.megatron.checkpoint_layout import (
    RELEASE,
    capture_rng_state,
    checkpoint_name,
    rank_extra,
    rank_file_name,
    rank_state,
    run_meta,
    tracker_writer,
)
from megatron_ext.megatron.core_state import install_lazy_wait, megatron_lm_formats, save_root
from megatron_ext.megatron.host_cache_size import AUTO, auto_host_cache, tensor_bytes
from megatron_ext.megatron.loading import CheckpointLoad, LoadRequest

log = logging.getLogger("megatron_ext.megatron")


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
        self._engine_world: Any = None  # the default process group the engine was made in
        self.bounds: fault_tolerance.WaitBounds | None = None  # the engine's waits on the training thread
        self._ft_ordered = False  # fault_tolerance.order_at_start_up ran
        # What a save keeps for the next one of the same structure (``owned``, ``forget_kept``).
        self._kept_model: model_state.ModelState | None = None
        self._kept_split: sharding.KeptSplit | None = None
        self._kept_optimizer: dict = {}

    def restarted(self) -> bool:
        """After an in-process restart (nvidia-resiliency-ext's ``--inprocess-restart``, or any caller
        that destroys the process groups and runs the training function again in the same
        processes): the engine of the attempt that failed is abandoned, committing nothing more,
        and the next save or load starts a new one. Returns whether that happened.

        Seen at the first checkpoint call of the new attempt, as a default process group other than
        the one the engine was made in: its threads, I/O worker, commit store and locks belong to
        the failed attempt's job, and the optimizer it waits in is gone. No default group at all is
        not a restart (a script that destroyed it before its last finalize): that engine ends as usual.
        """
        world = _default_group()
        if self.engine is None or world is None or world is self._engine_world:
            return False
        engine, self.engine, self.plan, self._engine_key, self.bounds = self.engine, None, None, None, None
        self.forget_kept()
        left = engine.abandon("an in-process restart: the process groups it committed through are gone")
        log.warning("[datastates] rank %d: in-process restart: the previous attempt's engine stopped (open "
                    "checkpoints abandoned: %s; threads still running: %s; host cache %s); a new engine starts",
                    engine.rank, ", ".join(left["open"]) or "none", ", ".join(left["running"]) or "none",
                    "freed" if left["cache_freed"] else "left to the garbage collector")
        return True

    # ------------------------------------------------------------------------ configuration
    def get_args(self) -> Any:
        if self.args is not None:
            return self.args
        try:
            from megatron.training import get_args  # present in a Megatron-LM checkout only
        except ImportError as exc:
            raise RuntimeError("megatron_ext.megatron.checkpointing.set_args(args) was not called") from exc
        args = get_args()
        if not self._ft_ordered:  # the first checkpoint call: FT's rank monitor client exists by then
            self._ft_ordered = True
            problems = fault_tolerance.order_at_start_up(args)
            if problems:
                raise ConfigError("invalid datastates configuration: " + "; ".join(problems))
        return args

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
        self.restarted()
        cfg = adapter_engine_config(args)
        key = tuple(sorted((k, str(v)) for k, v in cfg.items()))
        if self.engine is None:
            if cfg["host_cache_size"] == AUTO:
                if rank_bytes is None:
                    raise CheckpointError("--datastates-host-cache-size auto sizes the host cache from this rank's "
                                          "checkpoint bytes, which are not known yet; pass a size in GiB")
                sizing = auto_host_cache(rank_bytes, cfg, bytes_source)
                cfg["host_cache_size"] = sizing.gb
                log.info("%s", sizing.log_line())
            self.engine = CheckpointEngine(cfg)
            self._engine_key, self._engine_world = key, _default_group()
            self.bounds = fault_tolerance.WaitBounds(self.engine.config)
        elif key != self._engine_key:
            raise CheckpointError("the datastates configuration changed during the run; it is fixed at the first save")
        return self.engine

    def ownership(self, shards: list, groups: core_state.ParallelGroups) -> sharding.OwnershipPlan:
        """Who writes which shard: planned at the first save with one all-gather over the data-parallel group.

        Planned again (the same collective) when the set of shards changes, which happens on every
        rank at the same save: the optimizer's first step adds its moments (fp16 runs skip their
        first steps, saved before that).
        """
        signature = sharding.candidate_signature(shards)
        if self.plan is None or self.plan.signature != signature:
            layout = core_state.parallel_layout(groups)
            if self.plan is not None:
                log.info("[datastates] the sharded state changed (%d -> %d shards): planning ownership again",
                         len(self.plan.signature), len(signature))
            self.plan = sharding.plan_ownership(shards, layout["dp_rank"], layout["dp"], core_state.dp_gather(groups))
            log.info("[datastates] shard ownership: bytes per data-parallel rank %s", self.plan.bytes_by_dp_rank)
        return self.plan

    def owned(self, sharded: dict, model: list, groups: core_state.ParallelGroups,
              whole: tuple | None = None) -> tuple[dict, dict, dict]:
        """(tensors, objects, metadata) of the shards this rank writes (``sharding.split_owned``).

        Kept for the next save (``sharding.KeptSplit``) and reused while the shards' exact structure
        (``sharding.leaf_signature``: every leaf's fields and data memory) is the same; objects' values
        and copied buffers are taken from the shards each time. Any change takes the full path.
        ``whole``: the tokens of the kept model state and optimizer leaves that make up ``sharded``
        when nothing else does; the same tokens again are the same leaves, unwalked. The metadata
        comes as the kept split's ``Frozen`` when there is one (its encoding is reused).
        """
        kept = self._kept_split
        if whole is not None and kept is not None and kept.whole == whole:
            return kept.split(kept.leaves)
        shards = list(sharding.sharded_leaves(sharded))
        known = optimizer_state.kept_leaves(self._kept_optimizer) | self._kept_model.leaf_ids
        key = sharding.leaf_signature(shards, known)
        if key is not None and kept is not None and kept.key == key:
            kept.whole = whole
            return kept.split(shards)
        plan = self.ownership(shards, groups)
        tensors, objects, meta = sharding.split_owned(shards, plan)
        copied = core_state.copy_buffers_now(tensors, model)
        self._kept_split = None if key is None else sharding.keep_split(key, shards, tensors, objects, meta, copied,
                                                                         whole)
        return tensors, objects, (meta if self._kept_split is None else self._kept_split.meta)

    def forget_kept(self) -> None:
        """Drop what saves keep for the next one (it holds views of the model's and optimizer's memory)."""
        self._kept_model = None
        self._kept_split = None
        self._kept_optimizer = {}

    # ------------------------------------------------------------------------ save
    def save(self, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
             checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
             pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
             train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
             tp_group=None, pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None,
             rng_state_key_prefix=""):
        """``save_checkpoint``."""
        self.restarted()  # before the ownership plan: the failed attempt's is of its own process groups

        args = self.get_args()
        native = self.megatron_lm()
        chunks = model if isinstance(model, list) else [model]
        core_state.refuse_rng_key_prefix(rng_state_key_prefix)
        groups = core_state.ParallelGroups(tp_group, pp_group, dp_cp_group, dp_group, expt_dp_group)
        if native is not None and getattr(args, "ckpt_convert_format", None) is not None:
            # --ckpt-convert-format: Megatron-LM writes the state it just loaded in the format asked for
            # (setup_model_and_optimizer calls save_checkpoint itself, with no parameter sync before it).
            with megatron_lm_formats(args):
                return native.save_checkpoint(
                    iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context, non_persistent_ckpt=non_persistent_ckpt,
                    train_data_iterator=train_data_iterator,
                    preprocess_common_state_dict_fn=preprocess_common_state_dict_fn, release=release,
                    tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group, dp_group=dp_group,
                    expt_dp_group=expt_dp_group, rng_state_key_prefix=rng_state_key_prefix)
        started = time.monotonic()
        root = save_root(args, non_persistent_ckpt)
        gate = param_gather.gather_gate(args, chunks)  # copies wait for --overlap-param-gather's all-gathers
        model = core_state.unwrap(model)
        if native is not None:  # Energon data loaders keep their own state (a no-op for Megatron's own)
            native.maybe_save_dataloader_state(train_data_iterator, iteration, getattr(args, "dataloader_save", None),
                                               tp_group=tp_group, pp_group=pp_group, dp_group=dp_group)
        with_optimizer = not getattr(args, "no_save_optim", False)
        self._kept_model = model_state.model_state(model, core_state.model_keys(model),
                                                   core_state.model_metadata(groups), self._kept_model)
        sharded, common, optimizer_token = dict(self._kept_model.sharded), dict(self._kept_model.common), ()
        if with_optimizer and optimizer is not None:
            optimizer_part, optimizer_common, optimizer_token = optimizer_state.save_preprocessed(
                optimizer_state.model_space_state_dict(optimizer, self._kept_model.raw, False, self._kept_optimizer,
                                                       self._kept_model.token), self._kept_optimizer)
            sharded.update(optimizer_part)
            common.update(optimizer_common)
        whole = (None if self._kept_model.token is None or optimizer_token is None
                 else (self._kept_model.token, optimizer_token))
        tensors, objects, meta = self.owned(sharded, model, groups, whole)
        rank = torch.distributed.get_rank()
        layout = core_state.parallel_layout(groups)
        rng = None if getattr(args, "no_save_rng", False) else capture_rng_state()
        rerun = core_state.rerun_state(native, train_data_iterator)
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
        install_lazy_wait(optimizer, engine, wait_after_step=bool(getattr(args, "qk_clip", False)),
                          timeout=self.bounds.snapshot)
        name = checkpoint_name(RELEASE if release else iteration)
        engine.save(state, name, rank_file_name(rank), root=root, version=iteration, extra=rank_extra(objects, layout),
                    gate=gate, reuse=True)
        engine.commit(name, root=root, on_committed=tracker_writer(root, RELEASE if release else iteration, rank),
                      keep_last=1 if non_persistent_ckpt else None)
        log.info("[datastates] iteration %d: %scheckpoint recorded in %.4fs (%d tensors, %d objects owned here)",
                 iteration, "non-persistent " if non_persistent_ckpt else "", time.monotonic() - started,
                 len(tensors.value if isinstance(tensors, Frozen) else tensors), len(objects))

    def finalize(self, blocking: bool = False, terminate: bool = False) -> None:
        """``finalize_checkpoints``."""
        if self.engine is None or self.restarted():
            return
        if terminate:
            self.shutdown()
        elif blocking:
            self.engine.wait_persisted(timeout=self.bounds.persist())
        else:
            self.engine.raise_if_failed()

    def shutdown(self) -> None:
        """Stop the engine's threads; the next save starts a new engine and plans ownership again."""
        if self.engine is not None:
            self.engine.shutdown(timeout=self.bounds.persist())
        self.engine, self.plan, self.bounds = None, None, None
        self.forget_kept()

    # ------------------------------------------------------------------------ load
    def load(self, ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
             checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None,
             pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
        """``load_checkpoint`` (``loading.CheckpointLoad``); the run's engine starts after it when the run saves."""
        self.restarted()
        request = LoadRequest(ddp_model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict,
                              checkpointing_context=checkpointing_context,
                              skip_load_to_model_and_opt=skip_load_to_model_and_opt, tp_group=tp_group,
                              pp_group=pp_group, dp_cp_group=dp_cp_group, dp_group=dp_group,
                              expt_dp_group=expt_dp_group, rng_state_key_prefix=rng_state_key_prefix)
        return CheckpointLoad(self, self.get_args(), self.megatron_lm(), request).run()


def _default_group() -> Any:
    """The default process group now (a new object after an in-process restart), or None."""
    return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None


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
                    tp_group=None, pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None,
                    rng_state_key_prefix=""):
    """Record iteration ``iteration``'s state and return; flush and commit happen in the background.

    ``preprocess_common_state_dict_fn`` feeds only torch_dist's check that every rank holds the
    same common state; here one copy of it (global rank 0's) is saved, so it is not called.
    Saving an iteration that was already saved in this run (Megatron-LM does on a batch-size
    ramp-up step and for its rerun state machine) replaces that checkpoint, as in Megatron-LM.
    The process groups (``tp_group`` ... ``expt_dp_group``, from the model's ``pg_collection``) are
    used as Megatron-LM uses them (``core_state.ParallelGroups``); a ``rng_state_key_prefix`` (a
    multi-grid model's) is refused.
    """
    with fault_tolerance.checkpointing_section(_CHECKPOINTER.get_args()):  # where Megatron-LM's own save opens it
        return _CHECKPOINTER.save(
            iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
            checkpointing_context=checkpointing_context, pipeline_rank=pipeline_rank, expert_rank=expert_rank,
            tensor_rank=tensor_rank, pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel,
            non_persistent_ckpt=non_persistent_ckpt, train_data_iterator=train_data_iterator,
            preprocess_common_state_dict_fn=preprocess_common_state_dict_fn, release=release,
            tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group, dp_group=dp_group,
            expt_dp_group=expt_dp_group, rng_state_key_prefix=rng_state_key_prefix)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None,
                    pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
    """Load the checkpoint Megatron-LM would load; returns ``(iteration, num_floating_point_operations_so_far)``.

    Every file read is checked against the manifest's sizes and checksums. If any rank finds
    the checkpoint damaged, all ranks raise, or, with ``--datastates-load-fallback``, all move on
    to the next older committed checkpoint together. A checkpoint Megatron-LM wrote in its own
    format is loaded by Megatron-LM's own ``load_checkpoint``.
    """
    return _CHECKPOINTER.load(ddp_model, optimizer, opt_param_scheduler, load_arg=load_arg, strict=strict,
                              checkpointing_context=checkpointing_context,
                              skip_load_to_model_and_opt=skip_load_to_model_and_opt, tp_group=tp_group,
                              pp_group=pp_group, dp_cp_group=dp_cp_group, dp_group=dp_group,
                              expt_dp_group=expt_dp_group, rng_state_key_prefix=rng_state_key_prefix)


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
    """Megatron-LM's ``_load_base_checkpoint(rank0=True)`` for ``--use-checkpoint-args`` (``saved_run``)."""
    return saved_run.base_checkpoint_rank0(load_dir, args)


__all__ = ["MegatronCheckpointer", "checkpointer", "current_engine", "finalize_checkpoints", "get_engine",
           "install_lazy_wait", "load_base_checkpoint_rank0", "load_checkpoint", "save_checkpoint", "save_root",
           "set_args", "shutdown"]
