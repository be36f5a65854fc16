"""What a Megatron-LM load takes of the saved run besides the weights: which checkpoint to load, the
saved run's counters and argument checks, the RNG and rerun-state-machine states, and the saved args
``--use-checkpoint-args`` reads before the process group exists.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from megatron_ext.engine.errors import CheckpointError
from megatron_ext.engine.format.catalog import list_committed
from megatron_ext.engine.format.names import MANIFEST
from megatron_ext.engine.read.committed import CommittedCheckpoint
from megatron_ext.engine.object_store import under
from megatron_ext.megatron.checkpoint_layout import (
    CHECKPOINT_VERSION,
    NON_PERSISTENT_SUBDIR,
    RELEASE,
    RERUN_STATE,
    RNG,
    TRACKER_FILE,
    checkpoint_dir,
    file_of_rank,
    is_datastates_checkpoint,
    read_tracker,
    restore_rng_state,
    root_spelling,
)
from megatron_ext.megatron.core_state import save_root
from megatron_ext.megatron.shard_reads import ModelMismatch

log = logging.getLogger("megatron_ext.megatron")


def choose(load_dir: str | None, args: Any) -> tuple[str, int | str] | None:
    """The checkpoint Megatron-LM would load from ``load_dir``: ``(root, iteration or RELEASE)`` or None.

    As ``_load_base_checkpoint``: a non-persistent checkpoint at least as new as the persistent
    one wins; ``--ckpt-step`` overrides the tracker. Where the tracker is missing but committed
    checkpoints exist (a crash between the commit and the tracker's update), the newest committed
    one is taken, with a warning.
    """
    if load_dir is None:
        return None
    load_dir = root_spelling(load_dir)
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
            root_spelling(getattr(args, "non_persistent_global_ckpt_dir", None))
            or under(load_dir, NON_PERSISTENT_SUBDIR))
        np_iteration = read_tracker(np_root)
        if np_iteration == RELEASE:
            raise CheckpointError(f"{under(np_root, TRACKER_FILE)}: a non-persistent checkpoint cannot be a "
                                  "release")
        if np_iteration is not None and (iteration is None or iteration == RELEASE or np_iteration >= iteration):
            log.warning("[datastates] loading the non-persistent checkpoint of iteration %d from %s", np_iteration,
                        np_root)
            return np_root, np_iteration
    return (load_dir, iteration) if iteration is not None else None


def override_iteration(meta: dict, args: Any, where: str) -> dict:
    """``--override-ckpt-iteration N`` (Megatron-LM 0.19): resume as if at iteration N, the data loader at
    N global batches (``consumed_train_samples``), no samples skipped; refused when the saved run's global
    batch size differs (the loader would replay from the wrong offset). Returns the meta to use."""
    target = getattr(args, "override_ckpt_iteration", None)
    if target is None:
        return meta
    meta = dict(meta, iteration=target)
    saved_args = meta.get("args")
    if saved_args is not None:
        saved_gbs = getattr(saved_args, "global_batch_size", None)
        if saved_gbs is not None and saved_gbs != args.global_batch_size:
            raise ModelMismatch(f"{where}: --override-ckpt-iteration recomputes consumed_train_samples from the "
                                  f"target iteration and the current global batch size, but the checkpoint's "
                                  f"global batch size ({saved_gbs}) differs from the current one "
                                  f"({args.global_batch_size}): the data loader would replay from the wrong offset")
        saved_args = copy.copy(saved_args)
        saved_args.consumed_train_samples = target * args.global_batch_size
        saved_args.skipped_train_samples = 0
        meta["args"] = saved_args
    log.warning("[datastates] overriding the checkpoint's iteration to %d (consumed_train_samples = %d)", target,
                target * args.global_batch_size)
    return meta


def carry_args(native: Any, args: Any, saved_args: Any) -> None:
    """The saved run's progress counters, and (inside Megatron-LM) its argument checks."""
    if native is not None:
        native.check_checkpoint_args(saved_args)
    for field in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(args, field, getattr(saved_args, field, 0))
    if native is not None:
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)


def load_rerun_state(ckpt: CommittedCheckpoint, rank: int) -> None:
    """This rank's saved state of Megatron-LM's rerun state machine, when its file holds one the machine accepts."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    own = file_of_rank(ckpt, rank)
    if own is None:
        return
    reader = ckpt.reader(own)
    if not reader.has_part(RERUN_STATE):
        return
    saved = reader.part(RERUN_STATE)
    machine = get_rerun_state_machine()
    if machine.validate_state_dict(saved):
        machine.load_state_dict(saved)


def load_rngs(ckpt: CommittedCheckpoint, saved_args: Any, saved: dict, current: dict, args: Any) -> None:
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
        wanted = {"tp_rank": current["tp_rank"], "pp_rank": current["pp_rank"], "dp_rank": dp_rank}
        source = next((f.rank for f in ckpt.files() if isinstance(f.extra, dict) and isinstance(f.extra.get("layout"), dict)
                       and all(f.extra["layout"].get(k) == v for k, v in wanted.items())), None)
    own = file_of_rank(ckpt, source)
    if own is None:
        raise CheckpointError(f"{ckpt.checkpoint} has no RNG state for tensor rank {current['tp_rank']} and "
                              f"pipeline rank {current['pp_rank']}")
    restore_rng_state(ckpt.reader(own).part(RNG))


def base_checkpoint_rank0(load_dir: str | None, args: Any) -> tuple[dict | None, str, bool, None]:
    """Megatron-LM's ``_load_base_checkpoint(rank0=True)``: args and iteration, before distributed start-up.

    ``--use-checkpoint-args`` reads the saved args through it. Only rank 0's ``meta`` is read
    (no process group exists yet); its checksums are verified.
    """
    from megatron_ext.megatron.export import open_iteration, saved_meta

    chosen = choose(load_dir, args)
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
