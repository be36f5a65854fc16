"""What the adapter asks of megatron-core and Megatron-LM's run: the sharded state dict, the parallel
layout, the rerun state machine's state, the lazy wait on the optimizer, and where a checkpoint goes.

Save and load share these (``checkpointing.py`` and ``loading.py``); none of them touches the
engine's files. Everything from ``megatron`` is imported inside the functions: the module imports
where only megatron-core (no ``megatron.training``) is installed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch

from megatron_ext.engine.errors import CheckpointError
from megatron_ext.megatron import optimizer_state
from megatron_ext.engine.object_store import under
from megatron_ext.megatron.checkpoint_layout import NON_PERSISTENT_SUBDIR, root_spelling

if TYPE_CHECKING:
    from megatron_ext.engine import CheckpointEngine

DP_RESHARDABLE = "dp_reshardable"
DP_ZERO = "dp_zero_gather_scatter"
#: megatron-core's own optimizer formats (checkpoints converted from torch_dist): megatron-core builds
#: the state dict to load into, on the saved layout.
NATIVE_FORMATS = (DP_RESHARDABLE, DP_ZERO)


# ---------------------------------------------------------------------------- the sharded state dict
def unwrap(model: Any) -> list:
    """The bare model chunks (no DDP or Float16Module wrappers), as Megatron-LM saves them."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model if isinstance(model, list) else [model])


def model_keys(model: list) -> list[str]:
    """The state dict keys of the model chunks: ``model``, or ``model0``, ``model1``, ... with virtual pipelines."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """The process groups Megatron-LM hands to ``save_checkpoint`` / ``load_checkpoint``.

    Since megatron-core 0.19 its training loop takes them from the model's ``pg_collection``:
    ``dp_cp`` is the group replica ids are counted over (with generalized tensor parallelism, the
    weight-rematerialisation-inclusive one), ``dp`` the one the data loaders' state follows. Each
    one not given (None) is parallel_state's, as in Megatron-LM.
    """

    tp: Any = None
    pp: Any = None
    dp_cp: Any = None
    dp: Any = None
    expt_dp: Any = None

    def tensor(self) -> Any:
        from megatron.core import parallel_state as ps

        return self.tp if self.tp is not None else ps.get_tensor_model_parallel_group()

    def pipeline(self) -> Any:
        from megatron.core import parallel_state as ps

        return self.pp if self.pp is not None else ps.get_pipeline_model_parallel_group()

    def data_parallel_cp(self) -> Any:
        from megatron.core import parallel_state as ps

        return self.dp_cp if self.dp_cp is not None else ps.get_data_parallel_group(with_context_parallel=True)


def refuse_rng_key_prefix(prefix: str) -> None:
    """A multi-grid model namespaces its RNG state (``rng_state_key_prefix``); one file per rank holds
    one RNG state here, so such a model is refused rather than saved or loaded under the wrong name."""
    if prefix:
        raise CheckpointError(f"rng_state_key_prefix={prefix!r} (a multi-grid model's RNG namespace) is not "
                              "supported by --use-datastates; save this model with --ckpt-format torch_dist")


def model_metadata(groups: ParallelGroups) -> dict:
    """The content metadata Megatron-LM hands to ``sharded_state_dict`` (it decides the shard keys)."""
    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": groups.data_parallel_cp()}


def sharded_state(model: list, optimizer: Any, with_optimizer: bool, optimizer_format: str | None = None,
                  is_loading: bool = False, groups: ParallelGroups = ParallelGroups()) -> dict:
    """The sharded state dict saved (model-space optimizer) or to load into (the checkpoint's optimizer format).

    megatron-core's own formats (``NATIVE_FORMATS``: bucket-space ``dp_reshardable`` and the gathered
    ``dp_zero_gather_scatter``, which checkpoints converted from torch_dist carry, and
    ``dp_reshardable`` those saved before the model-space format) are built by megatron-core. A
    save builds it from what it keeps between saves instead (``MegatronCheckpointer.save``).
    """
    metadata = model_metadata(groups)
    sharded = {key: chunk.sharded_state_dict(metadata=metadata) for key, chunk in zip(model_keys(model), model)}
    if with_optimizer and optimizer is not None:
        if optimizer_format in NATIVE_FORMATS:
            sharded["optimizer"] = optimizer.sharded_state_dict(
                sharded, is_loading=True, metadata={**metadata, "distrib_optim_sharding_type": optimizer_format})
        else:
            sharded["optimizer"] = optimizer_state.model_space_state_dict(optimizer, sharded, is_loading)
    return sharded


def optimizer_format(saved: Any) -> str | None:
    """The optimizer format of a checkpoint's common ``optimizer`` state (chained optimizers: all the same)."""
    states = [saved] if isinstance(saved, dict) and "param_state_sharding_type" in saved else \
        [v for v in (saved or {}).values() if isinstance(v, dict)] if isinstance(saved, dict) else []
    kinds = {s.get("param_state_sharding_type") for s in states if "param_state_sharding_type" in s}
    if len(kinds) > 1:
        raise CheckpointError(f"the chained optimizers were saved in different formats: {sorted(map(str, kinds))}")
    return kinds.pop() if kinds else None


def model_kind_mismatch(saved_args: Any, model: list) -> str | None:
    """Why a checkpoint's model kind does not match this run's (GPT saved, a HybridModel built, or the
    reverse), or None. Megatron-LM 0.19 translates a GPT checkpoint into a HybridModel at load time
    (``gpt_checkpoint_interop``) for its own formats only; here the mismatch is named instead of failing
    as missing shards."""
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # a megatron-core without hybrid models
        return None

    def contains_hybrid(module: Any) -> bool:
        while module is not None:
            if isinstance(module, HybridModel):
                return True
            module = getattr(module, "module", None)
        return False

    runtime_hybrid = any(contains_hybrid(chunk) for chunk in model)
    saved_hybrid = bool(getattr(saved_args, "hybrid_layer_pattern", None) or
                        getattr(saved_args, "hybrid_override_pattern", None))
    if runtime_hybrid == saved_hybrid:
        return None
    if runtime_hybrid:
        return ("it was saved from a GPT model and this run builds a HybridModel: --use-datastates does not "
                "translate GPT checkpoints at load time; convert it with `megatron-ext convert --to torch_dist` "
                "and load that (Megatron-LM translates its own format)")
    return "it was saved from a HybridModel and this run builds a GPT model; load it with the hybrid entry point"


def copy_buffers_now(tensors: dict[str, torch.Tensor], model: list) -> set[str]:
    """Replace, in ``tensors`` (shard id -> data, a save's owned split), each module buffer by its copy.

    The lazy snapshot may read a tensor until the next optimizer step, which is the first thing
    to write parameters. Buffers are written elsewhere: ``--moe-router-enable-expert-bias``
    updates the routers' ``expert_bias`` in ``finalize_model_grads``, before that step, so a lazy
    copy of it could hold the next iteration's value. Buffers are small (one value per expert).
    The shards themselves are left as they are (the kept model state holds them for the next
    save). Returns the ids copied (``sharding.KeptSplit`` copies them again at each save).
    """
    storages = {b.untyped_storage().data_ptr() for chunk in model for b in chunk.buffers() if b.numel()}
    copied = set()
    for sid, data in tensors.items():
        if isinstance(data, torch.Tensor) and data.numel() and data.untyped_storage().data_ptr() in storages:
            tensors[sid] = data.clone()
            copied.add(sid)
    return copied


# ---------------------------------------------------------------------------- the parallel layout
def parallel_layout(groups: ParallelGroups = ParallelGroups()) -> dict:
    """This rank's place in the TP/PP/DP layout (the ``layout`` a checkpoint records)."""
    dist = torch.distributed
    tp, pp, dp = groups.tensor(), groups.pipeline(), groups.data_parallel_cp()
    return {
        "world_size": dist.get_world_size(),
        "tp": dist.get_world_size(tp), "pp": dist.get_world_size(pp), "dp": dist.get_world_size(dp),
        "tp_rank": dist.get_rank(tp), "pp_rank": dist.get_rank(pp), "dp_rank": dist.get_rank(dp),
    }


def dp_gather(groups: ParallelGroups = ParallelGroups()) -> Callable[[Any], list]:
    """An all-gather of one object over the group replica ids count over: the ownership plan's.

    parallel_state's data-parallel group has a gloo twin, used when the given group has its ranks
    (the object then never visits a GPU); another group (a model's own ``pg_collection``) is used as given.
    """
    from megatron.core import parallel_state as ps

    group = groups.data_parallel_cp()
    default = ps.get_data_parallel_group(with_context_parallel=True)
    if group is default or torch.distributed.get_process_group_ranks(group) == \
            torch.distributed.get_process_group_ranks(default):
        try:
            group = ps.get_data_parallel_group_gloo(with_context_parallel=True)
        except (AssertionError, AttributeError, RuntimeError):
            pass

    def gather(obj: Any) -> list:
        out: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    return gather


# ---------------------------------------------------------------------------- Megatron-LM's run
def rerun_state(native: Any, data_iterator: Any) -> dict | None:
    """This rank's state of Megatron-LM's rerun state machine, when it asks for a checkpoint; else None.

    Megatron-LM keeps its rank-level part in a ShardedObject of the world; here each rank's file
    holds its own part, so the object's data is stored in its place. Since megatron-core 0.19 the
    machine answers every save, with a placeholder (``NOT_RUNNING_YET``) when it has nothing to
    carry, so that torch_dist's structure stays the same; its loader refuses the placeholder, so
    it is not saved here (None, as before).
    """
    if native is None:
        return None
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    state = get_rerun_state_machine().state_dict(data_iterator=data_iterator, ckpt_format="torch_dist")
    if state is None or state.get("state") == RerunState.NOT_RUNNING_YET:
        return None
    return {k: (v.data if isinstance(v, ShardedObject) else v) for k, v in state.items()}


def save_root(args: Any, non_persistent: bool) -> str:
    """Where a checkpoint goes: ``--save``, or for a non-persistent one Megatron-LM's global directory."""
    if not non_persistent:
        return root_spelling(args.save)
    if getattr(args, "non_persistent_ckpt_type", None) != "global":
        raise CheckpointError(f"non-persistent checkpoint of type {getattr(args, 'non_persistent_ckpt_type', None)}: "
                              "--use-datastates writes 'global' ones (its node-local level is --datastates-local-dir)")
    return root_spelling(getattr(args, "non_persistent_global_ckpt_dir", None)) or under(root_spelling(args.save),
                                                                                        NON_PERSISTENT_SUBDIR)


class megatron_lm_formats:
    """Within the block Megatron-LM's own checkpoint functions take their native path (flag off)."""

    def __init__(self, args: Any):
        self.args = args

    def __enter__(self) -> None:
        self.args.use_datastates = False

    def __exit__(self, *exc: Any) -> None:
        self.args.use_datastates = True


# ---------------------------------------------------------------------------- the lazy wait
def install_lazy_wait(optimizer: Any, engine: CheckpointEngine, wait_after_step: bool = False,
                      timeout: Callable[[], float | None] = lambda: None) -> None:
    """Make ``optimizer.step_with_ready_grads`` wait for pending snapshots first (wrapped once).

    The wait goes to the engine of the latest call: an optimizer kept over an in-process restart
    waits for the new engine, not the abandoned one. ``wait_after_step``: also wait when ``step``
    returns, for code that edits the saved weights after the optimizer step even when the step
    itself was skipped (``--qk-clip``). ``timeout``: the wait's bound, asked at each wait (None: the
    engine's ``snapshot_timeout_s``; ``fault_tolerance.WaitBounds`` keeps it below FT's).
    """
    if optimizer is None:
        return
    optimizer._datastates_engine, optimizer._datastates_wait_timeout = engine, timeout
    if getattr(optimizer, "_datastates_lazy_wait", False):
        return
    inner_step = optimizer.step_with_ready_grads

    def step_with_ready_grads(*args: Any, **kwargs: Any):
        optimizer._datastates_engine.wait_snapshot(optimizer._datastates_wait_timeout())
        return inner_step(*args, **kwargs)

    optimizer.step_with_ready_grads = step_with_ready_grads
    if wait_after_step:
        outer_step = optimizer.step

        def step(*args: Any, **kwargs: Any):
            result = outer_step(*args, **kwargs)
            optimizer._datastates_engine.wait_snapshot(optimizer._datastates_wait_timeout())  # no-op after the inner step's
            return result

        optimizer.step = step
    optimizer._datastates_lazy_wait = True
