"""Megatron-LM's ``load_checkpoint`` on datastates checkpoints: which checkpoint, the fallback to
older ones, and one checkpoint's load in named steps.

A load reads through ``open_committed`` with no engine of its own: a staging cache of 1 MiB for
``O_DIRECT`` reads and the run's read settings (node-local level, threads, timeout). The run's
engine starts after the load (``CheckpointLoad.run``): its cache, which it touches in the
background, would otherwise take the cores and memory bandwidth the reads need. The run's engine
reads instead when it exists already, or with peer replicas, whose recovery is a collective of the
run's engine (its ``auto`` host cache then sized from the manifest it loads).

The steps of one checkpoint (``CheckpointLoad._load_from``), as Megatron-LM's own load orders them:

1. open it and agree on the level (every rank node-local, or every rank shared);
2. read rank 0's run meta (args, iteration, layout), carry the saved run's counters and checks;
3. decide on the optimizer (its format, its stored form checked before anything is read);
4. read every shard of the load template (``shard_reads``), merged with the common state;
5. load the model chunks (Transformer Engine's extra state checked first), then the optimizer
   and the scheduler;
6. the rerun state machine and the RNGs, where Megatron-LM restores them.

The "loaded" line in the log gives the seconds of each (``open``, ``meta``, ``allocate``, ``template``,
``read``, ``model``, ``optimizer``, ``rng``) on that rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch

from megatron_ext.engine.collectives import all_reduce_int
from megatron_ext.engine.config import EngineConfig
from megatron_ext.engine.device import rank_device
from megatron_ext.engine.errors import CheckpointError
from megatron_ext.engine.format.catalog import list_committed, read_manifest
from megatron_ext.engine.host_cache import HostCache
from megatron_ext.engine.object_store import resolve_root
from megatron_ext.engine.read.committed import CommittedCheckpoint, ReadOptions, open_committed
from megatron_ext import te_extra_state
from megatron_ext.megatron import core_state, hf_llama, optimizer_forms, optimizer_load, saved_run
from megatron_ext.megatron.args import MegatronAdapterOptions, adapter_engine_config
from megatron_ext.megatron.checkpoint_layout import (
    CHECKPOINT_VERSION,
    COMMON,
    RELEASE,
    checkpoint_dir,
    checkpoint_name,
    file_of_rank,
    is_megatron_lm_format,
    read_run_meta,
    read_tracker,
    root_spelling,
)
from megatron_ext.megatron.core_state import NATIVE_FORMATS
from megatron_ext.megatron.host_cache_size import checkpoint_rank_bytes
from megatron_ext.megatron.shard_assembly import SavedShards
from megatron_ext.megatron.shard_reads import ModelMismatch, fill_sharded, reshard_source, shard_index

if TYPE_CHECKING:
    from megatron_ext.engine import CheckpointEngine

log = logging.getLogger("megatron_ext.megatron")

#: The staging cache of a load without an engine, as the engine's configuration cuts it: 4 slots of 256 KiB.
READER_CACHE_GB = 1 / 1024


class RunEngine(Protocol):
    """What a load needs of the process's checkpointer: the run's engine, when it has one, and making it."""

    engine: "CheckpointEngine | None"

    def get_engine(self, args: Any = None, rank_bytes: int | None = None,
                   bytes_source: str = "") -> "CheckpointEngine": ...


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """The arguments of Megatron-LM's ``load_checkpoint``."""

    ddp_model: Any
    optimizer: Any
    opt_param_scheduler: Any
    load_arg: str = "load"
    strict: bool = True
    checkpointing_context: Any = None
    skip_load_to_model_and_opt: bool = False
    tp_group: Any = None
    pp_group: Any = None
    dp_cp_group: Any = None
    dp_group: Any = None
    expt_dp_group: Any = None
    rng_state_key_prefix: str = ""

    @property
    def groups(self) -> core_state.ParallelGroups:
        return core_state.ParallelGroups(self.tp_group, self.pp_group, self.dp_cp_group, self.dp_group,
                                         self.expt_dp_group)

    def native_load(self, native: Any) -> Any:
        """Megatron-LM's own ``load_checkpoint`` with these arguments (a checkpoint in its own format)."""
        return native.load_checkpoint(
            self.ddp_model, self.optimizer, self.opt_param_scheduler, load_arg=self.load_arg, strict=self.strict,
            checkpointing_context=self.checkpointing_context,
            skip_load_to_model_and_opt=self.skip_load_to_model_and_opt, tp_group=self.tp_group,
            pp_group=self.pp_group, dp_cp_group=self.dp_cp_group, dp_group=self.dp_group,
            expt_dp_group=self.expt_dp_group, rng_state_key_prefix=self.rng_state_key_prefix)


@dataclasses.dataclass
class _Saved:
    """What a load learns of one checkpoint before it reads a shard."""

    root: str  # as the load was given it (messages)
    ckpt: CommittedCheckpoint
    tensor_index: dict[str, tuple[str, str]]
    object_index: dict[str, str]
    meta: dict  # rank 0's run meta: args, iteration, layout, scheduler
    common: dict  # rank 0's common state
    layout: dict  # this run's parallel layout
    reshard: SavedShards | None  # the source when the layout changed, else None (exact shard ids)

    @property
    def saved_layout(self) -> dict:
        return self.meta["layout"]


class CheckpointLoad:
    """One ``load_checkpoint`` call: the checkpoint chosen, each candidate tried, the run's engine started after."""

    def __init__(self, owner: RunEngine, args: Any, native: Any, request: LoadRequest):
        """``native``: Megatron-LM's ``megatron.training.checkpointing`` inside its loop, else None."""
        self.owner, self.args, self.native, self.request = owner, args, native, request
        # This rank's bytes in the checkpoint last opened, and whence: an ``auto`` host cache's size.
        self.rank_bytes: tuple[int | None, str] = (None, "")
        self.step_seconds: dict[str, float] = {}  # of the last checkpoint tried, for the log

    @contextlib.contextmanager
    def _step(self, name: str) -> Iterator[None]:
        """Time one step of a checkpoint's load (summed when it repeats) for the "loaded" log line."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.step_seconds[name] = self.step_seconds.get(name, 0.0) + time.perf_counter() - started

    def run(self) -> tuple[int, Any]:
        """``(iteration, num_floating_point_operations_so_far)`` of the checkpoint loaded; ``(0, 0)`` for none."""
        args, native = self.args, self.native
        load_dir = root_spelling(getattr(args, self.request.load_arg, None))
        pretrained = root_spelling(getattr(args, "pretrained_checkpoint", None))
        finetune_from_pretrained = pretrained is not None and (load_dir is None or read_tracker(load_dir) is None)
        if finetune_from_pretrained:  # as Megatron-LM: no checkpoint of this run yet, so fine-tune from that one
            log.warning("[datastates] no checkpoint in %s: fine-tuning from the pretrained checkpoint in %s",
                        load_dir, pretrained)
            load_dir = pretrained
        chosen = saved_run.choose(load_dir, args)
        if chosen is not None and native is not None and is_megatron_lm_format(checkpoint_dir(*chosen)):
            log.warning("[datastates] %s holds a checkpoint in Megatron-LM's own format: Megatron-LM loads it; "
                        "checkpoints saved from now on are datastates checkpoints", chosen[0])
            with core_state.megatron_lm_formats(args):
                return self.request.native_load(native)
        core_state.refuse_rng_key_prefix(self.request.rng_state_key_prefix)
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
        if MegatronAdapterOptions.from_args(args).load_fallback and iteration != RELEASE:
            committed = [m["version"] for _, m in list_committed(root) if isinstance(m.get("version"), int)]
            candidates += sorted((v for v in committed if v < iteration), reverse=True)
        return self._first_loadable(root, candidates)

    def _first_loadable(self, root: str, candidates: list) -> tuple[int, Any]:
        """Load the first candidate every rank loads; the ranks agree on each outcome, so all move on together."""
        started = time.monotonic()
        for n, candidate in enumerate(candidates):
            error: BaseException | None = None
            try:
                *result, levels = self._load_iteration(root, candidate)
            except CheckpointError as exc:
                error = exc
            # On the world's device (CUDA under NCCL, which refuses host tensors): 0 loaded, 1 damaged,
            # 2 saved from another model (every older checkpoint of the run would be too).
            outcome = 0 if error is None else 2 if isinstance(error, ModelMismatch) else 1
            outcome = all_reduce_int(outcome, torch.distributed.ReduceOp.MAX)
            if not outcome:
                steps = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.step_seconds.items())
                log.warning("[datastates] loaded %s from %s (%s level) in %.2fs (%s): iteration %d",
                            checkpoint_name(candidate), root, levels, time.monotonic() - started, steps, result[0])
                if getattr(self.args, "save", None):  # now, so its cache is ready before the first save's copies
                    self.owner.get_engine(self.args, *self.rank_bytes)
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

    # ------------------------------------------------------------------------ one checkpoint
    def _load_iteration(self, root: str, iteration: int | str) -> tuple[int, Any, str]:
        """Load one committed checkpoint as Megatron-LM's ``load_checkpoint`` does; also the levels read.

        Which parts are loaded follows Megatron-LM: the optimizer and the scheduler unless
        ``--no-load-optim``, ``--finetune`` or a release checkpoint (otherwise the fp32 main params
        are refreshed from the loaded weights); RNGs unless ``--no-load-rng``, ``--finetune``, a
        release, or another TP/PP layout; the rerun state machine only on the same world and layout.
        """
        self.step_seconds = {}
        with self._opened(root, iteration) as ckpt:
            return self._load_from(root, ckpt, iteration)

    def _run_engine(self, root: str, iteration: int | str) -> "CheckpointEngine | None":
        """The run's engine when it reads this checkpoint (it exists, or peer replicas are on); else None."""
        args = self.args
        peers = bool(getattr(args, "save", None) and getattr(args, "datastates_peer_replica", False))
        if self.owner.engine is None and peers:
            manifest = read_manifest(checkpoint_dir(root, iteration))
            if manifest is not None:
                self.rank_bytes = _rank_bytes(manifest, checkpoint_name(iteration))
            return self.owner.get_engine(args, *self.rank_bytes)
        return self.owner.get_engine(args) if self.owner.engine is not None else None

    @contextlib.contextmanager
    def _opened(self, root: str, iteration: int | str) -> Iterator[CommittedCheckpoint]:
        """Step 1: checkpoint ``iteration`` opened (by the run's engine, or with a staging cache of its own,
        freed after the load) and every rank's level agreed."""
        name = checkpoint_name(iteration)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        staging: HostCache | None = None
        try:
            with self._step("open"):
                engine = self._run_engine(root, iteration)
                if engine is not None:
                    ckpt = engine.open_checkpoint(name, root=root)
                else:
                    config = EngineConfig.from_dict({**adapter_engine_config(self.args), "save_dir": root,
                                                     "host_cache_size": READER_CACHE_GB}, probe=False)
                    staging = HostCache(config.host_cache_bytes, config.chunk_bytes, pin=torch.cuda.is_available(),
                                        device=rank_device())
                    options = ReadOptions.from_config(config, rank=rank, staging=staging,
                                                      classes=config.allowed_classes())
                    ckpt = open_committed(resolve_root(root), name, options)
                self.rank_bytes = _rank_bytes(ckpt.manifest, ckpt.checkpoint)
                level = ckpt.agree_level(rank, world)  # every rank node-local, or every rank shared
                log.info("[datastates] rank %d reads %s from the %s level", rank, ckpt.checkpoint, level)
            yield ckpt
        finally:
            if staging is not None:
                staging.close()

    def _load_from(self, root: str, ckpt: CommittedCheckpoint, iteration: int | str) -> tuple[int, Any, str]:
        """Steps 2 to 6 on the opened checkpoint: ``(iteration, floating point operations, levels read)``."""
        args, request = self.args, self.request
        release = iteration == RELEASE
        finetune = bool(getattr(args, "finetune", False))
        with self._step("meta"):
            saved = self._saved_run(root, ckpt, finetune)
        optimizer_format = core_state.optimizer_format(saved.common.get("optimizer"))
        with_optimizer = (request.optimizer is not None and not release and not finetune
                          and not getattr(args, "no_load_optim", False))
        if with_optimizer:
            with self._step("allocate"):
                self._prepare_optimizer(saved, optimizer_format)
        state, object_sources = self._read_state(saved, optimizer_format, with_optimizer)
        with self._step("model"):
            if not request.skip_load_to_model_and_opt:
                self._load_model(state, saved, object_sources)
        with self._step("optimizer"):
            if with_optimizer:
                self._load_optimizer(state, saved, optimizer_format)
            elif request.optimizer is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
                request.optimizer.reload_model_params()  # the fp32 main params start from the loaded weights
        with self._step("rng"):
            if not release and not finetune:
                self._load_run_state(saved)
        if request.optimizer is not None:  # as Megatron-LM, for optimizers of checkpoints that predate the field
            for group in request.optimizer.param_groups:
                group.setdefault("default_config", True)
        # No barrier here: the caller's all-reduce of every rank's outcome is the synchronisation
        # point, and a rank that failed is already waiting in it.
        levels = "/".join(sorted(ckpt.levels_used)) or "no"
        loaded_iteration = 0 if finetune or release else saved.meta["iteration"]
        return loaded_iteration, saved.meta.get("num_floating_point_operations_so_far", 0), levels

    def _saved_run(self, root: str, ckpt: CommittedCheckpoint, finetune: bool) -> _Saved:
        """Step 2: the shard index, rank 0's meta and common state; the saved run's args carried over."""
        tensor_index, object_index = shard_index(ckpt)
        zero_name = file_of_rank(ckpt, 0)
        if zero_name is None:
            raise CheckpointError(f"{ckpt.checkpoint} has no file of rank 0 (its common state and args)")
        meta = saved_run.override_iteration(read_run_meta(ckpt.reader(zero_name)), self.args, ckpt.checkpoint)
        layout = core_state.parallel_layout(self.request.groups)
        reshard = reshard_source(ckpt, meta["layout"], layout)
        if self.native is not None:
            self.native.set_checkpoint_version(meta.get("checkpoint_version", CHECKPOINT_VERSION))
        if meta.get("args") is not None:
            mismatch = core_state.model_kind_mismatch(meta["args"], core_state.unwrap(self.request.ddp_model))
            if mismatch:
                raise ModelMismatch(f"{ckpt.checkpoint} cannot load into this model: {mismatch}")
        imported = meta.get(hf_llama.IMPORTED)
        if isinstance(imported, dict) and meta.get("args") is not None:  # even with --finetune: shapes do not show all
            problems = hf_llama.argument_mismatches(meta["args"], self.args)
            if problems:
                raise ModelMismatch(f"{ckpt.checkpoint} holds the {imported.get('architecture')} imported from "
                                    f"{imported.get('directory')}, which this run's arguments do not build: "
                                    + "; ".join(problems))
        if meta.get("args") is not None and not finetune:  # before any weight is read: a wrong shape fails by name
            saved_run.carry_args(self.native, self.args, meta["args"])
        common = ckpt.reader(zero_name).part(COMMON)
        return _Saved(root, ckpt, tensor_index, object_index, meta, common, layout, reshard)

    def _prepare_optimizer(self, saved: _Saved, optimizer_format: str | None) -> None:
        """Step 3: refuse what cannot load before anything is read or allocated; allocate the state read into."""
        optimizer, name, common = self.request.optimizer, saved.ckpt.checkpoint, saved.common
        if "optimizer" not in common:
            raise CheckpointError(f"{name} holds no optimizer state (saved with --no-save-optim); "
                                  "pass --no-load-optim or --finetune to load it without")
        if optimizer_format in NATIVE_FORMATS and saved.reshard is not None:
            raise CheckpointError(f"{name} holds the optimizer in megatron-core's {optimizer_format} format "
                                  "(converted from torch_dist), which loads on the saved TP/PP/DP layout only; "
                                  "torch_dist checkpoints in fully_reshardable convert to a reshardable one")
        if optimizer_format not in NATIVE_FORMATS:
            optimizer_forms.check_stored_form(optimizer, common.get("optimizer"), checkpoint=name,
                                              resharding=saved.reshard is not None)
        if not optimizer_forms.saved_before_first_step(common.get("optimizer")):
            optimizer_load.allocate_state(optimizer)  # every value is read into it below; else main params only

    def _read_state(self, saved: _Saved, optimizer_format: str | None, with_optimizer: bool) -> tuple[dict, dict]:
        """Step 4: the state dict to load (every shard read, merged with the common state), and the loaded
        objects' sources."""
        from megatron.core.dist_checkpointing.dict_utils import merge
        from megatron.core.dist_checkpointing.mapping import apply_factory_merges
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        model = core_state.unwrap(self.request.ddp_model)
        with self._step("template"):
            template = core_state.sharded_state(model, self.request.optimizer, with_optimizer, optimizer_format,
                                                is_loading=True, groups=self.request.groups)
            sharded, nonpersistent, factories = load_preprocess(template)
            sharded, _ = extract_sharded_base(sharded)  # the non-sharded values come from the saved "common"
        # Converted from fully_reshardable: the optimizer's boxes are whole, each rank's slices are cut from them.
        boxes = (saved.reshard or SavedShards(saved.ckpt)) if with_optimizer and optimizer_forms.whole_boxes(
            saved.common.get("optimizer")) else None
        with self._step("read"):
            object_sources = fill_sharded(saved.ckpt, sharded, saved.tensor_index, saved.object_index, saved.reshard,
                                          boxes)
        common = saved.common
        merge(common, nonpersistent)
        merge(common, sharded)
        return apply_factory_merges(common, factories), object_sources

    def _load_model(self, state: dict, saved: _Saved, object_sources: dict[int, str]) -> None:
        """Step 5: each model chunk; Transformer Engine unpickles its fp8 extra state in ``load_state_dict``,
        so every chunk's is checked first."""
        model = core_state.unwrap(self.request.ddp_model)
        keys = core_state.model_keys(model)
        allow_pickle = MegatronAdapterOptions.from_args(self.args).allow_pickle
        fallback = f"{saved.ckpt.checkpoint} in {saved.root}"
        for key in keys:
            te_extra_state.check_extra_state(state[key], allow_pickle=allow_pickle,
                                             where=lambda _, value: object_sources.get(id(value), fallback))
        for key, chunk in zip(keys, model):
            _load_model_chunk(chunk, state[key], self.request.strict)

    def _load_optimizer(self, state: dict, saved: _Saved, optimizer_format: str | None) -> None:
        """Step 5, continued: the optimizer (unless ``skip_load_to_model_and_opt``) and the scheduler."""
        optimizer, scheduler = self.request.optimizer, self.request.opt_param_scheduler
        if not self.request.skip_load_to_model_and_opt:
            if optimizer_format in NATIVE_FORMATS:
                with optimizer_load.steps_set_aside(optimizer):
                    optimizer.load_state_dict(state["optimizer"])
                # --optimizer-cpu-offload: megatron-core's dp_reshardable and dp_zero_gather_scatter
                # readers set HDO.state without handing it to the sub-optimizers.
                optimizer_load.sync_hybrid(optimizer)
                optimizer_load.restore_adam_steps(optimizer)
            else:
                optimizer_load.check_param_groups(optimizer, state["optimizer"])
                optimizer_load.load_model_space_state_dict(optimizer, state["optimizer"])
        if scheduler is not None and saved.meta.get("scheduler") is not None:
            scheduler.load_state_dict(saved.meta["scheduler"])

    def _load_run_state(self, saved: _Saved) -> None:
        """Step 6 (not for a release or ``--finetune``): the rerun state machine on the same world and layout,
        the RNGs unless ``--no-load-rng``."""
        layout, saved_layout = saved.layout, saved.saved_layout
        same_run_layout = all(saved_layout.get(k) == layout[k] for k in ("world_size", "tp", "pp", "dp"))
        if self.native is not None and same_run_layout:
            saved_run.load_rerun_state(saved.ckpt, torch.distributed.get_rank())
        if not getattr(self.args, "no_load_rng", False):
            saved_run.load_rngs(saved.ckpt, saved.meta.get("args"), saved_layout, layout, self.args)


def _rank_bytes(manifest: dict, checkpoint: str) -> tuple[int, str]:
    """This rank's bytes in a committed checkpoint (``checkpoint_rank_bytes``), and whence, for ``get_engine``."""
    world = torch.distributed.get_world_size()
    same = manifest.get("world_size") == world
    return (checkpoint_rank_bytes(manifest, torch.distributed.get_rank(), world),
            f"its file in the loaded {checkpoint}" if same else
            f"estimated from the loaded {checkpoint}, saved by {manifest.get('world_size')} ranks")


def _load_model_chunk(chunk: Any, state: dict, strict: bool) -> None:
    """``load_state_dict``; as Megatron-LM, a strict load that fails is retried non-strictly (and said)."""
    try:
        chunk.load_state_dict(state, strict=strict)
    except Exception as exc:
        if not strict:
            raise
        result = chunk.load_state_dict(state, strict=False)
        log.warning("[datastates] strict model load failed (%s); loaded non-strictly: %s", exc, result)
