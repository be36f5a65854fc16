"""``megatron-ext convert``: this project's checkpoints to megatron-core ``torch_dist`` and back.

Both directions run in one process (a gloo world of 1) and keep Megatron's layout:
``<out>/iter_NNNNNNN/`` plus ``<out>/latest_checkpointed_iteration.txt``. Either side may be
named by its save directory (the newest committed checkpoint, or the tracker's, unless
``--iteration``/``--checkpoint`` says which) or by the checkpoint's own directory.

Optimizer formats, every one megatron-core 0.19.0 writes for a distributed optimizer:

=============================  =============================================  ==================================
torch_dist format              to datastates                                   back to torch_dist
=============================  =============================================  ==================================
``dp_reshardable`` (default)   bucket-space tensors and objects as they are;  ``dp_reshardable``
                               loads on the saved layout only
``fully_reshardable``          whole parameter boxes, stored in this           ``fully_reshardable``
(``--dist-ckpt-optim-fully-    project's model-space format (the loader cuts
reshardable``, also its        each rank's flat slice out of them): loads on
``mem_efficient`` variant)     any TP/PP/DP layout
``dp_zero_gather_scatter``     data-parallel rank 0's gathered state as one    ``dp_zero_gather_scatter``
(deprecated, still written     object; the loader scatters it as megatron-core
on request)                    does; same TP x PP, any DP
no distributed optimizer       per-parameter tensors as they are               the same
=============================  =============================================  ==================================

Refused, naming the format: ``fully_sharded_model_space`` (megatron-core 0.19.0 cannot write it:
its ``ShardedTensor`` rejects ``flattened_range``), ``fsdp_dtensor`` (Megatron FSDP, which
``--use-datastates`` does not support) and anything else.

To ``torch_dist``: every saved shard becomes a ``ShardedTensor`` / ``ShardedObject`` with the
metadata recorded at save time and is written by megatron-core's ``dist_checkpointing.save``.
Optimizer state saved in model space (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``, flat
per-data-parallel slices, or whole boxes after a conversion) is joined into whole parameter boxes
and written in megatron-core's ``fully_reshardable`` format (``optimizer.state.param.<key>``), which
megatron-core loads onto any layout; the other formats are written as they are. The checkpoint's
``content_metadata`` names the format, as Megatron-LM's checkpoints do, so a loader builds the
matching state dict.

From ``torch_dist``: megatron-core's metadata (``load_sharded_metadata``) lists every tensor and
object; the tensors are cut into the chunks the original ranks wrote (the DCP metadata's chunks),
which are the shards of that layout (views, not copies), spread over as many rank files as the run
had ranks and written by the engine's ``OfflineWriter``: one rank's file after the other through one
chunk-sized buffer, in this process, so neither memory nor processes grow with the number of ranks.
The result is the committed checkpoint (files, reports, manifest, tracker) the engine writes for
those states, which ``--use-datastates`` resumes from.

The non-sharded state is mapped between the two containers: this adapter's ``meta`` (iteration,
scheduler, args, layout) and per-rank ``rng`` vs the reference trainer's ``iteration``,
``opt_param_scheduler``, ``args`` and Megatron-LM's ``rng_state`` object per (pp, tp) coordinate.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import re
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.read.committed import open_committed
from megatron_ext.megatron import checkpoint_layout as ckpt_layout
from megatron_ext.megatron.export import rank_zero_file, saved_meta
from megatron_ext.megatron.safe_classes import megatron_safe_classes
from megatron_ext.megatron.shard_assembly import SavedShards

MODEL_SPACE_STATE = "optimizer.state."  # + {fp32_param, exp_avg, exp_avg_sq}.<model key>
MODEL_SPACE = "fully_sharded_model_space"
FULLY_RESHARDABLE = "fully_reshardable"
DP_RESHARDABLE = "dp_reshardable"
DP_ZERO = "dp_zero_gather_scatter"
#: megatron-core's torch_dist optimizer formats that convert to this project's format.
CONVERTIBLE = (DP_RESHARDABLE, FULLY_RESHARDABLE, DP_ZERO)
RNG_KEY = "rng_state"
#: torch_dist's common state, an object inside the .distcp files since megatron-core 0.19 (no common.pt).
COMMON_STATE_KEY = "common_state"
FP32_PARAM, PARAM = MODEL_SPACE_STATE + "fp32_param.", MODEL_SPACE_STATE + "param."


def optimizer_states(saved: Any) -> list[dict]:
    """Each (chained) distributed optimizer's part of a common ``optimizer`` state (the dicts themselves)."""
    if not isinstance(saved, dict):
        return []
    if "param_state_sharding_type" in saved:
        return [saved]
    return [v for v in saved.values() if isinstance(v, dict) and "param_state_sharding_type" in v]


def sharding_type_of(saved: Any) -> str | None:
    """The one optimizer format of a common ``optimizer`` state (None: no distributed optimizer)."""
    kinds = {state.get("param_state_sharding_type") for state in optimizer_states(saved)}
    if len(kinds) > 1:
        raise CheckpointError(f"the chained optimizers were saved in different formats: {sorted(map(str, kinds))}")
    return kinds.pop() if kinds else None


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A gloo world of one process for megatron-core's dist_checkpointing (unless one exists)."""
    from megatron_ext.megatron.cpu_device import enable_cpu_device
    from megatron_ext.procs import free_port

    enable_cpu_device()  # a no-op where CUDA is available
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ to torch_dist
def _sharded_tensor(key: str, data: torch.Tensor, meta: dict) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor(key, data, data.dtype, tuple(meta["local_shape"]), tuple(meta["global_shape"]),
                         tuple(meta["global_offset"]), tuple(meta.get("axis_fragmentations") or ()) or None,
                         replica_id=0, prepend_axis_num=meta.get("prepend_axis_num", 0))


def _datastates_source(source: Any, iteration: int | None, checkpoint: str | None) -> Any:
    """The committed Megatron checkpoint ``source`` names (a ``locate.Located`` or a path)."""
    from megatron_ext import locate

    located = source if isinstance(source, locate.Located) else locate.resolve(source, iteration, checkpoint)
    if located.kind != locate.MEGATRON:
        from megatron_ext.engine.read.verify import verify_checkpoint

        # Damage first, as every tool reports it (reports, sizes, headers; no checksums): a damaged
        # checkpoint is named as such, whatever its kind.
        problems = verify_checkpoint(located.root, located.name, deep=False)
        if problems:
            raise CheckpointError(f"{located.root}/{problems[0]}")
        hint = ("`megatron-ext export` gives its consolidated weights" if located.kind == locate.DEEPSPEED else
                "only checkpoints saved by the Megatron adapter (--use-datastates) have a torch_dist form")
        raise CheckpointError(f"{located.path} is {locate.describe_kind(located.kind)}, not one the Megatron adapter "
                              f"saved (iter_*); {hint}")
    return located


def to_torch_dist(source: Any, iteration: int | None = None, out: str | None = None, *,
                  checkpoint: str | None = None, progress: Any = None) -> dict[str, Any]:
    """Write a committed Megatron datastates checkpoint as ``torch_dist`` in ``out``.

    ``source``: a save directory (with ``iteration``/``checkpoint``, else the newest committed
    checkpoint) or one checkpoint's directory, or a ``locate.Located``. ``progress``: a
    ``megatron_ext.progress.Progress`` (bytes of the shards read).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ext.megatron.optimizer_forms import OWN_KEYS, describe, is_plain, saved_forms

    if out is None:
        raise ValueError("convert needs an output directory")
    located = _datastates_source(source, iteration, checkpoint)
    committed = open_committed(located.root, located.name, ckpt_layout.read_options(), manifest=located.manifest)
    meta = saved_meta(committed)
    iteration = meta["iteration"]
    common = committed.reader(rank_zero_file(committed)).part(ckpt_layout.COMMON)
    if not isinstance(common, dict):
        raise CheckpointError(f"{committed.checkpoint}: rank 0's common state is not a dict")
    stored = [form for form in saved_forms(common.get("optimizer")) if not is_plain(form)]
    if stored:  # megatron-core's torch_dist optimizer formats hold unscaled fp32 state
        raise CheckpointError(f"{located.path}: its optimizer state is in the stored "
                              f"form of --use-precision-aware-optimizer ({describe(stored[0])}), which megatron-core's "
                              "torch_dist optimizer formats do not hold; convert does not support it (the model "
                              "weights export with `megatron-ext export`)")
    layout = meta["layout"]
    optimizer = common.get("optimizer")
    sharding_type = sharding_type_of(optimizer)
    model_space = sharding_type == MODEL_SPACE
    shards = SavedShards(committed)
    shards.check()  # every shard's metadata and tensor, every key covered: before anything is written
    target = ckpt_layout.new_checkpoint_dir(out, iteration)

    def renamed(key: str) -> str:
        # fully_reshardable names the fp32 main copy "param" where the model-space format says "fp32_param".
        return PARAM + key[len(FP32_PARAM):] if model_space and key.startswith(FP32_PARAM) else key

    pieces = shards.shard_meta()
    if progress is not None:
        progress.total_bytes = sum(_piece_bytes(piece) for _, _, piece in pieces)
        progress.total_files = len(committed.files())
    tensors: list[Any] = []
    objects: list[Any] = []
    boxes: dict[tuple, dict] = {}  # model-space optimizer state: one whole box per parameter shard
    files_done: set[str] = set()
    for name, sid, piece in pieces:
        reader = committed.reader(name)
        if "local_shape" not in piece:
            objects.append(ShardedObject(piece["key"], reader.part("shards", "objects", sid),
                                         tuple(piece["global_shape"]), tuple(piece["global_offset"]), replica_id=0))
        elif piece.get("flattened_range") is None:
            tensors.append(_sharded_tensor(renamed(piece["key"]), reader.part("shards", "tensors", sid), piece))
        elif piece["key"].startswith(MODEL_SPACE_STATE):
            boxes.setdefault((piece["key"], tuple(piece["global_offset"]), tuple(piece["local_shape"])), piece)
            continue  # read below, joined
        else:
            raise CheckpointError(f"shard {sid}: a flattened slice of {piece['key']}, which no torch_dist "
                                  "format of megatron-core 0.19.0 stores")
        if progress is not None:
            progress.update(_piece_bytes(piece), int(name not in files_done))
            files_done.add(name)
    for (key, offset, local_shape), piece in sorted(boxes.items()):
        data = shards.read_shard(key, offset, local_shape, piece.get("prepend_axis_num", 0))
        tensors.append(_sharded_tensor(renamed(key), data, piece))
        if progress is not None:
            progress.update(data.numel() * data.element_size())

    optimizer = copy.copy(optimizer)
    if isinstance(optimizer, dict) and "param_state_sharding_type" not in optimizer:
        optimizer = {k: copy.copy(v) if isinstance(v, dict) else v for k, v in optimizer.items()}
    for state in optimizer_states(optimizer):
        for own in OWN_KEYS:  # this project's records; megatron-core's formats do not have them
            if own != "param_state_sharding_type":
                state.pop(own, None)
        if model_space:
            state["param_state_sharding_type"] = FULLY_RESHARDABLE
    if model_space:
        sharding_type = FULLY_RESHARDABLE
    rng_objects = []
    for file in committed.files():
        rank_layout = ckpt_layout.rank_layout_of(file)
        skeleton = committed.reader(file.name).skeleton()
        if rank_layout is None or not (isinstance(skeleton, dict) and ckpt_layout.RNG in skeleton):
            continue
        if rank_layout["dp_rank"] == 0:  # Megatron-LM keeps data-parallel rank 0's per (pp, tp)
            rng_objects.append(ckpt_layout.megatron_lm_rng_object(committed.reader(file.name).part(ckpt_layout.RNG),
                                                                  {**layout, **rank_layout}))
    args = meta.get("args")
    state = {
        **{k: v for k, v in common.items() if k != "optimizer"},
        # Sharded leaves are stored by their own keys; this container name never reaches the files.
        "datastates_shards": {"tensors": tensors, "objects": objects},
        "optimizer": optimizer,
        RNG_KEY: rng_objects,
        "opt_param_scheduler": meta.get("scheduler"),
        "iteration": iteration,
        "args": args,  # a Namespace, as Megatron-LM saves and reads it
        "checkpoint_version": meta.get("checkpoint_version", ckpt_layout.CHECKPOINT_VERSION),
        "num_floating_point_operations_so_far": meta.get("num_floating_point_operations_so_far", 0),
    }
    content = {"distrib_optim_sharding_type": sharding_type} if sharding_type else None
    if progress is not None:
        progress.note(f"writing {len(tensors)} tensors and {len(objects)} objects with megatron-core's "
                      "dist_checkpointing.save")
    with single_process_group():
        os.makedirs(target)
        dist_checkpointing.save(state, target, content_metadata=content)
    ckpt_layout.write_tracker(out, iteration)
    return {"source": located.path, "out": target, "iteration": iteration, "tensors": len(tensors),
            "objects": len(objects), "rng_states": len(rng_objects), "optimizer_format": sharding_type}


def _piece_bytes(piece: dict) -> int:
    if "local_shape" not in piece:
        return 0
    from megatron_ext.megatron.shard_assembly import SHARD_DTYPES

    numel = math.prod(piece["local_shape"])
    if piece.get("flattened_range") is not None:
        start, stop = piece["flattened_range"]
        numel = stop - start
    return numel * SHARD_DTYPES[piece["dtype"]].itemsize  # validated by SavedShards


# ------------------------------------------------------------------------------ from torch_dist
TORCH_DIST_METADATA = "metadata.json"


def _source_checkpoint(source: str, iteration: int | None, checkpoint: str | None = None) -> tuple[str, int | None]:
    """(checkpoint directory, iteration or None when only the checkpoint's common state says it).

    ``source`` is a torch_dist save directory (then ``iteration`` or ``checkpoint`` names one,
    else the Megatron tracker does) or one checkpoint's own directory (it holds ``metadata.json``).
    """
    source = os.path.normpath(source)
    if os.path.isfile(os.path.join(source, TORCH_DIST_METADATA)):
        name = os.path.basename(os.path.abspath(source))
        match = re.fullmatch(r"iter_(\d+)", name)
        own = int(match.group(1)) if match else None
        if (iteration is not None and iteration != own) or (checkpoint is not None and checkpoint != name):
            raise CheckpointError(f"{source} is checkpoint {name}, but --iteration/--checkpoint asks for another")
        return source, own
    if not os.path.isdir(source):
        raise CheckpointError(f"{source} is not a directory")
    if checkpoint is not None:
        path = os.path.join(source, checkpoint)
        match = re.fullmatch(r"iter_(\d+)", checkpoint)
        iteration = int(match.group(1)) if match else None
    else:
        if iteration is None:
            iteration = ckpt_layout.read_tracker(source)
            if iteration is None:
                raise CheckpointError(f"{source} has no {ckpt_layout.TRACKER_FILE}; pass --iteration N, or the "
                                      "save directory of a torch_dist run, or one iter_* directory of it")
        path = ckpt_layout.checkpoint_dir(source, iteration)
    if not os.path.exists(os.path.join(path, TORCH_DIST_METADATA)):
        why = "a datastates checkpoint: convert it --to torch_dist" if ckpt_layout.is_datastates_checkpoint(path) \
            else "no metadata.json"
        raise CheckpointError(f"{path} is not a megatron-core distributed checkpoint ({why})")
    return path, (None if iteration == ckpt_layout.RELEASE else iteration)


def _rank_of(tp_rank: int, pp_rank: int, dp_rank: int, layout: dict) -> int:
    """Megatron's default rank order (tp fastest, then dp, then pp; no context/expert parallelism)."""
    return tp_rank + layout["tp"] * (dp_rank + layout["dp"] * pp_rank)


def from_torch_dist(source: str, out: str, iteration: int | None = None, chunk_mb: float = 16.0, *,
                    checkpoint: str | None = None, progress: Any = None) -> dict[str, Any]:
    """Write a torch_dist checkpoint (``source``: its save directory, default the tracker's, or its own
    directory) as a committed datastates one in ``out``; ``chunk_mb``: the writer's one buffer."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_ext.engine.save.offline_writer import OfflineWriter  # the writing direction only
    from megatron_ext.megatron.optimizer_forms import BOXES, PLAIN_FORM, STORED_FORM

    ckpt, iteration = _source_checkpoint(source, iteration, checkpoint)
    if progress is not None:
        progress.note(f"reading {ckpt} with megatron-core's dist_checkpointing.load")
    with single_process_group():
        common = dist_checkpointing.load_common_state_dict(ckpt)
        # The common state (``common_state``, an object in the .distcp files since megatron-core 0.19)
        # is ``common`` above, not a shard.
        template = {k: v for k, v in load_sharded_metadata(ckpt).items() if v.key != COMMON_STATE_KEY}
        # load() replaces the template's entries; keep what they describe.
        described = {k: (v.key, tuple(v.global_offset), tuple(v.global_shape), isinstance(v, ShardedObject))
                     for k, v in template.items()}
        loaded = dist_checkpointing.load(template, ckpt, validate_access_integrity=False)
    chunks = {k: v.chunks for k, v in FileSystemReader(ckpt).read_metadata().state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}

    args = common.get("args")
    args = argparse.Namespace(**args) if isinstance(args, dict) else args
    if args is None:
        raise CheckpointError(f"{ckpt} has no args in its common state: its parallel layout is unknown")
    if iteration is None:
        iteration = common.get("iteration")
        if not isinstance(iteration, int):
            raise CheckpointError(f"{ckpt}: its common state names no iteration")
    layout = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
              "dp": getattr(args, "data_parallel_size", None)}
    if layout["dp"] is None:
        layout["dp"] = args.world_size // (layout["tp"] * layout["pp"])
    world = layout["tp"] * layout["pp"] * layout["dp"]
    content = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
    optimizer_common = copy.deepcopy(common.get("optimizer") or {})
    sharding_type = sharding_type_of(optimizer_common) or (
        content.get("distrib_optim_sharding_type") if optimizer_states(optimizer_common) else None)
    if sharding_type not in (None, *CONVERTIBLE):
        why = {MODEL_SPACE: "megatron-core 0.19.0 can neither write nor read it (its ShardedTensor rejects "
                            "flattened_range); load it with the megatron-core that wrote it and save it again in "
                            "fully_reshardable",
               "fsdp_dtensor": "Megatron FSDP's format; --use-datastates does not support FSDP"}.get(
            sharding_type, "not a format megatron-core 0.19.0 writes")
        raise CheckpointError(f"{ckpt}: optimizer format {sharding_type!r}: {why}. convert takes "
                              f"{', '.join(CONVERTIBLE)} and checkpoints without a distributed optimizer")
    fully_reshardable = sharding_type == FULLY_RESHARDABLE
    if fully_reshardable:
        # Whole parameter boxes: this project's model-space format, whose loader cuts each rank's
        # flat slice out of them (BOXES), on any layout. "param" is the model-space "fp32_param".
        for state in optimizer_states(optimizer_common):
            state.pop("param_state", None)
            state.update({"param_state_sharding_type": MODEL_SPACE, STORED_FORM: dict(PLAIN_FORM), BOXES: True})

    # Which rank file holds which chunk: the least loaded so far, in key order. A chunk is a view
    # of the loaded tensor, not a copy; the writer copies it through its buffer into the file.
    per_rank = [{"tensors": {}, "objects": {}, "meta": {}} for _ in range(world)]
    load = [0] * world
    rngs: dict[int, dict] = {}
    if progress is not None:
        progress.total_bytes = sum(loaded[k].numel() * loaded[k].element_size() for k, d in described.items()
                                   if not d[3] and isinstance(loaded.get(k), torch.Tensor))
        progress.total_files = world
    for key, (object_key, object_offset, object_shape, is_object) in sorted(described.items()):
        value = loaded[key]
        if is_object:
            if object_key == RNG_KEY:
                pp_rank, tp_rank, *dp = object_offset
                # Megatron-LM's (pp, tp) entries hold data-parallel rank 0's state, which every
                # data-parallel rank loads; the older (pp, tp, dp) entries are per rank.
                for dp_rank in dp or range(layout["dp"]):
                    rngs[_rank_of(tp_rank, pp_rank, dp_rank, layout)] = ckpt_layout.from_megatron_lm_rng(value)
                continue
            sid = f"{object_key}@{','.join(str(o) for o in object_offset)}"
            owner = min(range(world), key=lambda r: (load[r], r))
            per_rank[owner]["objects"][sid] = value
            per_rank[owner]["meta"][sid] = {"key": object_key, "global_shape": list(object_shape),
                                           "global_offset": list(object_offset)}
            load[owner] += 64
            continue
        saved_key = key
        if fully_reshardable and key.startswith(PARAM):
            saved_key = FP32_PARAM + key[len(PARAM):]
        for chunk in chunks[key]:
            offset, size = tuple(chunk.offsets), tuple(chunk.sizes)
            data = value[tuple(slice(o, o + s) for o, s in zip(offset, size))]
            sid = f"{saved_key}@{','.join(str(o) for o in offset)}"
            owner = min(range(world), key=lambda r: (load[r], r))
            per_rank[owner]["tensors"][sid] = data
            per_rank[owner]["meta"][sid] = {"key": saved_key, "global_shape": list(value.shape),
                                           "global_offset": list(offset), "local_shape": list(size),
                                           "dtype": str(data.dtype).removeprefix("torch."),
                                           "axis_fragmentations": [], "prepend_axis_num": 0}
            load[owner] += data.numel() * data.element_size()
    missing = sorted(set(range(world)) - set(rngs))
    if missing:
        raise CheckpointError(f"{ckpt}: no rng_state for rank(s) {missing[:8]} of the {world}-rank layout {layout}")
    shard_count = sum(len(p["meta"]) for p in per_rank)

    model_common = {k: v for k, v in common.items()
                    if k not in ("optimizer", "args", "iteration", "opt_param_scheduler", "checkpoint_version",
                                 "num_floating_point_operations_so_far", "content_metadata", RNG_KEY)}
    saved_common = {**model_common, "optimizer": optimizer_common} if optimizer_common else model_common
    name = ckpt_layout.checkpoint_name(iteration)
    target = ckpt_layout.new_checkpoint_dir(out, iteration)
    # One writer for every rank's file, one rank after the other, through one buffer of one chunk:
    # memory and processes do not grow with the number of ranks (an engine per rank would hold a
    # host cache and an I/O worker each until rank 0 commits).
    config = {"chunk_size_mb": chunk_mb, "safe_classes": list(megatron_safe_classes())}
    with OfflineWriter(config, out, name, world_size=world, version=iteration) as writer:
        for rank in range(world):
            coords = {"tp_rank": rank % layout["tp"], "dp_rank": (rank // layout["tp"]) % layout["dp"],
                      "pp_rank": rank // (layout["tp"] * layout["dp"])}
            rank_layout = {"world_size": world, **{k: layout[k] for k in ("tp", "pp", "dp")}, **coords}
            run = None
            if rank == 0:
                run = ckpt_layout.run_meta(
                    iteration, common.get("num_floating_point_operations_so_far", 0),
                    common.get("opt_param_scheduler"), args, rank_layout,
                    checkpoint_version=common.get("checkpoint_version", ckpt_layout.CHECKPOINT_VERSION))
            shards = per_rank[rank]
            state = ckpt_layout.rank_state(shards, rngs[rank], common=saved_common if rank == 0 else None, meta=run)
            writer.save(rank, state, ckpt_layout.rank_file_name(rank),
                        extra=ckpt_layout.rank_extra(shards["objects"], rank_layout))
            if progress is not None:
                progress.update(sum(t.numel() * t.element_size() for t in shards["tensors"].values()), 1)
            per_rank[rank] = None  # its views go; the loaded tensors stay until the end
        writer.commit(on_committed=ckpt_layout.tracker_writer(out, iteration, 0))
    return {"source": ckpt, "out": target, "iteration": iteration, "ranks": world,
            "shards": shard_count, "layout": layout,
            "optimizer_format": sharding_type, "loads_as": MODEL_SPACE if fully_reshardable else sharding_type}
