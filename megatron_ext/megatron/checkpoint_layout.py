"""The Megatron checkpoint layout in one place: names, the tracker file, what each rank writes.

Everything that writes or reads this project's Megatron checkpoints (the drop-in
``checkpointing``, ``convert``, ``export``, the reference trainer, the benchmarks) names things
through this module, so the layout is defined once. It stays Megatron-LM's on the outside::

    <save>/latest_checkpointed_iteration.txt   the tracker: an iteration number or "release"
    <save>/iter_0000123/                       one checkpoint ("release" for a release)
        manifest.json                          written by the engine's commit
        rank00000.<run>.safetensors ...        one file per global rank

Each rank's file holds the parts ``rank_state`` assembles:

* ``shards``: ``tensors`` / ``objects`` (the shards this rank owns, by shard id) and ``meta``
  (each shard's global placement, docs/FORMAT.md);
* ``rng``: this rank's Python, NumPy, torch, CUDA and model-parallel tracker RNG states
  (``capture_rng_state``), unless the run saves no RNG;
* ``rerun_state_machine``: this rank's state of Megatron-LM's rerun state machine, when it has one;
* on global rank 0 only, ``common`` (the non-sharded state) and ``meta`` (``run_meta``).

The file's manifest entry carries ``extra`` = ``rank_extra(...)``: the object shard ids it holds
and the rank's parallel layout. The RNG functions also translate to and from the ``rng_state``
object of Megatron-LM's own ``torch_dist`` checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from typing import Any, Callable, Iterable

import numpy as np
import torch

from megatron_ext.engine import CheckpointError, object_store
from megatron_ext.engine.files import atomic_write
from megatron_ext.engine.format.catalog import entry_exists, manifest_exists
from megatron_ext.engine.format.names import MANIFEST
from megatron_ext.engine.read.committed import CommittedCheckpoint, ReadOptions
from megatron_ext.engine.format.entries import FileEntry
from megatron_ext.engine.object_store import is_object_url, under
from megatron_ext.megatron.safe_classes import megatron_classes

log = logging.getLogger("megatron_ext.megatron")

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # a tracker holding this names the checkpoint directory "release" (iteration 0)
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's default home of non-persistent checkpoints
CHECKPOINT_VERSION = 3.0  # the Megatron-LM checkpoint version this layout answers to
TRACKER_MAX_BYTES = 4096  # an iteration number or "release": more is not a tracker

# The parts of a rank's state (see the module docstring).
SHARDS, RNG, RERUN_STATE, COMMON, META = "shards", "rng", "rerun_state_machine", "common", "meta"


# ---------------------------------------------------------------------------- names
def checkpoint_name(iteration: int | str) -> str:
    """``iter_0000123``, or ``release``."""
    return RELEASE if iteration == RELEASE else f"iter_{iteration:07d}"


def root_spelling(root: str | None) -> str | None:
    """A --save/--load root as the adapter passes it on: an ``s3://`` URL in its one spelling (no trailing
    slash, so names join onto it as keys), a path unchanged (the engine makes it absolute)."""
    return object_store.normalize(root) if is_object_url(root) else root


def checkpoint_dir(root: str, iteration: int | str) -> str:
    return under(root, checkpoint_name(iteration))


def new_checkpoint_dir(root: str, iteration: int | str) -> str:
    """Where a tool writes ``iteration``'s checkpoint under ``root`` (a directory, made if missing, or an
    ``s3://`` prefix): only where nothing is yet, so no earlier checkpoint is mixed with the new one."""
    path = checkpoint_dir(root, iteration)
    if entry_exists(path):
        raise FileExistsError(f"{path} exists; write into a directory without that checkpoint")
    if not object_store.is_object_url(root):
        os.makedirs(root, exist_ok=True)
    return path


def rank_file_name(rank: int) -> str:
    """The name a rank's file has in the manifest (``rank00003``)."""
    return f"rank{rank:05d}"


def file_of_rank(committed: CommittedCheckpoint, rank: int) -> str | None:
    """The name of the file global rank ``rank`` wrote in ``committed`` (the adapter writes one per rank), or None."""
    return next((entry.name for entry in committed.files_of_rank(rank)), None)


def read_options(**overrides: Any) -> ReadOptions:
    """How this adapter's tools open a checkpoint (``engine.read.committed.open_committed``):
    checksums verified, the sidecar allowed the classes a Megatron run saves (``safe_classes``)."""
    return ReadOptions(**{"classes": megatron_classes(), **overrides})


def is_datastates_checkpoint(directory: str) -> bool:
    """A directory the engine committed (it has a manifest; on the object-store level, a manifest object)."""
    if is_object_url(directory):
        return manifest_exists(directory)
    return os.path.isfile(os.path.join(directory, MANIFEST))


def is_megatron_lm_format(directory: str) -> bool:
    """A checkpoint Megatron-LM wrote itself: torch_dist (``metadata.json``) or legacy torch (``mp_rank_*``).

    Never on the object-store level: Megatron-LM's own formats are read through the file system, so an
    ``s3://`` checkpoint is one of ours or none (the load then says it is not committed)."""
    if is_object_url(directory) or not os.path.isdir(directory) or is_datastates_checkpoint(directory):
        return False
    return os.path.isfile(os.path.join(directory, "metadata.json")) or any(
        name.startswith("mp_rank_") for name in os.listdir(directory))


# ---------------------------------------------------------------------------- tracker
def read_tracker(directory: str) -> int | str | None:
    """The tracker's iteration, ``RELEASE``, or None when there is no tracker (a file, or an object under an
    ``s3://`` root: one GET, a missing object or bucket being no tracker)."""
    path = under(directory, TRACKER_FILE)
    try:
        if is_object_url(path):
            text = object_store.get(path, max_bytes=TRACKER_MAX_BYTES).decode("utf-8").strip()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text: not an iteration number or '{RELEASE}'") from None
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number or '{RELEASE}'")
    return int(text)


def write_tracker(directory: str, iteration: int | str) -> None:
    """Name ``iteration`` the latest checkpoint under ``directory``, atomically (an object is written whole:
    one PUT under an ``s3://`` root)."""
    path, data = under(directory, TRACKER_FILE), str(iteration).encode()
    if is_object_url(path):
        object_store.put(path, data)
    else:
        atomic_write(path, data)


def tracker_writer(directory: str, iteration: int | str, rank: int) -> Callable[[dict], None]:
    """The engine's commit callback: rank 0 writes the tracker once the checkpoint is committed."""
    def write_on_commit(manifest: dict) -> None:
        if rank == 0:
            write_tracker(directory, iteration)
            log.info("[datastates] committed %s in %s (%d files)", checkpoint_name(iteration), directory,
                     len(manifest["files"]))

    return write_on_commit


# ---------------------------------------------------------------------------- what each rank writes
def run_meta(iteration: int, num_floating_point_operations_so_far: Any, scheduler: Any, args: Any, layout: dict,
             checkpoint_version: Any = CHECKPOINT_VERSION) -> dict:
    """Rank 0's ``meta`` part; ``args`` is stored as ``storable_args(args)``."""
    return {
        "iteration": iteration,
        "checkpoint_version": checkpoint_version,
        "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
        "scheduler": scheduler,
        "args": storable_args(args),
        "layout": layout,
    }


def rank_state(shards: dict, rng: dict | None = None, rerun_state: dict | None = None,
               common: dict | None = None, meta: dict | None = None) -> dict[str, Any]:
    """The state one rank saves; parts given as None are left out (``common``/``meta``: rank 0 only)."""
    state: dict[str, Any] = {SHARDS: shards}
    for part, value in ((RNG, rng), (RERUN_STATE, rerun_state), (COMMON, common), (META, meta)):
        if value is not None:
            state[part] = value
    return state


def read_run_meta(reader: Any) -> dict:
    """Rank 0's ``meta`` part (``run_meta``) from its file's reader, checked before any use: a dict
    with a whole-number ``iteration`` and a ``layout`` of whole-number ``tp``, ``pp``, ``dp``."""
    meta = reader.part(META)
    layout = meta.get("layout") if isinstance(meta, dict) else None
    if not isinstance(layout, dict) or not all(type(layout.get(k)) is int and layout[k] >= 1 for k in ("tp", "pp", "dp")):
        raise CheckpointError(f"{reader.state_path}: its meta records no parallel layout (whole-number tp, pp, dp)")
    if type(meta.get("iteration")) is not int:
        raise CheckpointError(f"{reader.state_path}: its meta's iteration {meta.get('iteration')!r} is not a whole number")
    return meta


def rank_extra(objects: Any, layout: dict) -> dict:
    """The manifest's ``extra`` of a rank's file: the object shard ids it holds, its parallel layout."""
    return {"objects": sorted(objects), "layout": layout}


def rank_layout_of(file: FileEntry) -> dict | None:
    """A file's parallel layout from its manifest ``extra`` (``rank_extra``), None if it records
    none; the ranks in it are whole numbers, else ``CheckpointError`` (``extra`` is not validated
    with the manifest: it is the adapter's)."""
    layout = file.extra.get("layout") if isinstance(file.extra, dict) else None
    if layout is None:
        return None
    if not isinstance(layout, dict) or not all(type(layout.get(k)) is int and layout[k] >= 0
                                               for k in ("tp_rank", "pp_rank", "dp_rank")):
        raise CheckpointError(f"file {file.name!r}: its manifest entry's layout {str(layout)[:120]} lacks "
                              "whole-number tp_rank, pp_rank and dp_rank")
    return layout


def is_megatron_checkpoint(files: Iterable[FileEntry]) -> bool:
    """Whether every file of a committed checkpoint (``CommittedCheckpoint.files()``) was written by
    this adapter (``rank_extra``)."""
    files = list(files)
    return bool(files) and all(isinstance(f.extra, dict) and {"objects", "layout"} <= set(f.extra) for f in files)


def storable_args(args: Any) -> argparse.Namespace:
    """A copy of args whose values the safe sidecar can hold; others become their repr()."""
    from megatron_ext.engine.errors import EncodeError
    from megatron_ext.engine.format.codec import Encoder

    plain = argparse.Namespace()
    classes = None
    for key, value in vars(args).items():
        if type(value) not in _PLAIN:  # hundreds of args in Megatron-LM, nearly all plain: rank 0 at every save
            classes = classes if classes is not None else megatron_classes()
            try:
                Encoder(classes=classes).encode(value)
            except EncodeError:
                value = repr(value)  # inert: a class not on the allow-list is never rebuilt at load
        setattr(plain, key, value)
    return plain


_PLAIN = frozenset((type(None), bool, int, float, str))  # what the sidecar holds as it is


# ---------------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict:
    """Every RNG a training step can consume on this rank (the ``rng`` part).

    The model-parallel tracker's states are state tensors, or ``torch.Generator`` objects when the
    tracker is graph-safe (CUDA graphs, ``--te-rng-tracker``). A generator advances in place as it
    draws, so it is stored as the state tensor it has now (a copy made here, at the save).
    """
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {name: value.get_state() if isinstance(value, torch.Generator) else value
                    for name, value in tracker.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``: saved tracker states go back in the form the tracker keeps.

    A graph-safe tracker keeps generators: the one it has under a name takes the saved state in
    place (CUDA graphs hold that object); a name it lacks gets a generator made by megatron-core's
    own conversion.
    """
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    graph_safe = tensor_parallel.is_graph_safe_cuda_rng_tracker(tracker)
    restored = {}
    for name, saved in state["tracker"].items():
        mine = current.get(name)
        if isinstance(mine, torch.Generator):
            mine.set_state(saved)
            restored[name] = mine
        else:
            restored[name] = tensor_parallel.convert_cuda_rng_state(saved, to_graphable=True) if graph_safe else saved
    tracker.set_states(restored)


# Megatron-LM's names for the RNG states in its ``rng_state`` entries, and ours.
MEGATRON_LM_RNG_NAMES = {"random_rng_state": "random", "np_rng_state": "numpy", "torch_rng_state": "torch",
                         "cuda_rng_state": "cuda", "rng_tracker_states": "tracker"}


def megatron_lm_rng_object(rng: dict | None, layout: dict) -> Any:
    """An ``rng_state`` ShardedObject as Megatron-LM's torch_dist checkpoints hold it.

    One entry per (pipeline, tensor) coordinate, replicated over data parallelism (data-parallel
    rank 0's is written), holding a one-element list of the states under Megatron-LM's names.
    ``rng`` is ours (``capture_rng_state()``), or None for a load template.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def theirs_from(ours: str) -> Any:
        value = rng.get(ours)
        # Without CUDA, Megatron-LM's "CUDA" state is the CPU generator's (its CPU runs save that).
        return rng["torch"] if value is None and ours == "cuda" else value

    data = None if rng is None else [{theirs: theirs_from(ours) for theirs, ours in MEGATRON_LM_RNG_NAMES.items()}]
    return ShardedObject("rng_state", data, (layout["pp"], layout["tp"]), (layout["pp_rank"], layout["tp_rank"]),
                         replica_id=layout["dp_rank"])


def from_megatron_lm_rng(data: Any) -> dict:
    """Our RNG dict (``capture_rng_state()``'s keys) from a Megatron-LM ``rng_state`` entry (list or dict)."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict) or not set(MEGATRON_LM_RNG_NAMES) - {"cuda_rng_state"} <= set(data):
        raise CheckpointError(f"rng_state of an unknown structure ({type(data).__name__})")
    rng = {ours: data[theirs] for theirs, ours in MEGATRON_LM_RNG_NAMES.items() if theirs in data}
    if rng.get("cuda") is None:
        rng.pop("cuda", None)
    return rng
