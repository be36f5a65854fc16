"""``megatron-ext export``: a committed checkpoint's model weights as consolidated safetensors files.

Each output tensor is one global tensor, assembled from the pieces every rank saved
(``shard_assembly.SavedShards``), so the export does not depend on the TP/PP/DP layout of the
run. Files are written in Hugging Face's sharded-checkpoint shape: ``model-0000K-of-0000N.safetensors``
no larger than ``--max-shard-size`` (a single larger tensor gets a file of its own) and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), written last, so a
directory with an index is complete. Tensors are produced one file at a time: memory holds one
output file's tensors plus the global tensor being assembled.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import torch
from safetensors.torch import save_file

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.commit import read_manifest
from megatron_ext.engine.engine import CommittedCheckpoint
from megatron_ext.megatron import hf_gpt2
from megatron_ext.megatron.checkpoint_layout import checkpoint_dir, file_of_rank, read_run_meta
from megatron_ext.megatron.safe_classes import megatron_classes
from megatron_ext.megatron.shard_assembly import SavedShards

INDEX = "model.safetensors.index.json"
OPTIMIZER_PREFIX = "optimizer."
DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9 bytes (Hugging Face's convention: GB = 10**9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number and a unit such as 500MB, 5GB or 2GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def open_iteration(root: str, iteration: int) -> CommittedCheckpoint:
    """The committed checkpoint ``iter_NNNNNNN`` under a Megatron save directory (checksums verified on read)."""
    path = checkpoint_dir(root, iteration)
    manifest = read_manifest(path) if os.path.isdir(path) else None
    if manifest is None:
        raise CheckpointError(f"{path} is not a committed datastates checkpoint (no manifest.json); "
                              f"`megatron-ext inspect {root}` lists the committed ones")
    return CommittedCheckpoint(os.path.abspath(root), None, os.path.basename(path), manifest, True,
                               classes=megatron_classes())


def saved_meta(committed: CommittedCheckpoint) -> dict:
    """Rank 0's ``meta``: iteration, args, parallel layout, scheduler."""
    zero = file_of_rank(committed.manifest, 0)
    if zero is None:
        raise CheckpointError(f"{committed.checkpoint} has no file of rank 0")
    return read_run_meta(committed.reader(zero))


def model_keys(shards: SavedShards) -> list[str]:
    """Keys of the model's weights (megatron-core names every optimizer key ``optimizer.*``)."""
    return [k for k in shards.keys() if not k.startswith(OPTIMIZER_PREFIX)]


def megatron_plan(shards: SavedShards, keys: list[str], dtype: torch.dtype | None) -> list[hf_gpt2.OutputTensor]:
    """One output tensor per key, under megatron-core's distributed-checkpoint name."""
    def produce(key: str) -> torch.Tensor:
        tensor = shards.read_global(key)
        return tensor if dtype is None else tensor.to(dtype)

    return [hf_gpt2.OutputTensor(k, tuple(shards.global_shape(k)), dtype or shards.dtype(k),
                                 lambda k=k: produce(k)) for k in keys]


def group_into_files(plan: list[hf_gpt2.OutputTensor], max_bytes: int) -> list[list[hf_gpt2.OutputTensor]]:
    """Consecutive tensors packed into files of at most ``max_bytes`` (a larger tensor alone)."""
    files: list[list[hf_gpt2.OutputTensor]] = []
    size = 0
    for item in plan:
        nbytes = _nbytes(item)
        if not files or (size + nbytes > max_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(item)
        size += nbytes
    return files


def _nbytes(item: hf_gpt2.OutputTensor) -> int:
    return math.prod(item.shape) * torch.empty((), dtype=item.dtype).element_size()


def write_sharded(plan: list[hf_gpt2.OutputTensor], out: str, max_bytes: int, metadata: dict) -> dict:
    """Write the files and then the index; returns the index."""
    files = group_into_files(plan, max_bytes)
    weight_map: dict[str, str] = {}
    for n, group in enumerate(files, start=1):
        file_name = f"model-{n:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for item in group:
            tensor = item.produce()
            if tuple(tensor.shape) != item.shape or tensor.dtype != item.dtype:
                raise CheckpointError(f"{item.name}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                      f"planned {item.shape} {item.dtype}")
            tensors[item.name] = tensor
            weight_map[item.name] = file_name
        save_file(tensors, os.path.join(out, file_name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(_nbytes(i) for i in plan), **metadata}, "weight_map": weight_map}
    with open(os.path.join(out, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return index


def export_safetensors(root: str, iteration: int, out: str, max_shard_size: str = "5GB",
                       dtype: str = "keep", names: str = "megatron") -> dict[str, Any]:
    """Export iteration ``iteration``'s model weights under ``root`` to ``out``; returns a summary."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    if names not in ("megatron", "hf"):
        raise ValueError(f"--names {names!r}: choose megatron or hf")
    max_bytes = parse_size(max_shard_size)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out} exists and is not an empty directory; export writes into a new one")
    committed = open_iteration(root, iteration)
    meta = saved_meta(committed)
    shards = SavedShards(committed)
    keys = model_keys(shards)
    cast = DTYPES[dtype]
    config = None
    if names == "hf":
        def read_layer(key: str, layer: int | None) -> torch.Tensor:
            if layer is None:
                return shards.read_global(key)
            shape = tuple(shards.global_shape(key))
            return shards.read_box(key, (layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:]).reshape(shape[1:])

        plan, config = hf_gpt2.plan_gpt2({k: tuple(shards.global_shape(k)) for k in keys},
                                         {k: shards.dtype(k) for k in keys}, meta.get("args"), read_layer, cast)
    else:
        plan = megatron_plan(shards, keys, cast)
    os.makedirs(out, exist_ok=True)
    if config is not None:
        with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    index = write_sharded(plan, out, max_bytes, {"iteration": str(iteration), "names": names})
    return {"out": out, "iteration": iteration, "tensors": len(plan),
            "files": len(set(index["weight_map"].values())), "total_size": index["metadata"]["total_size"],
            "names": names, "layout": meta.get("layout")}
