"""``megatron-ext export``: a committed checkpoint's model weights as consolidated safetensors files.

Each output tensor is one global tensor, assembled from the pieces every rank saved
(``shard_assembly.SavedShards``), so the export does not depend on the TP/PP/DP layout of the
run. Files are written in Hugging Face's sharded-checkpoint shape: ``model-0000K-of-0000N.safetensors``
no larger than ``--max-shard-size`` (a single larger tensor gets a file of its own) and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), written last, so a
directory with an index is complete. Tensors are produced one file at a time: memory holds one
output file's tensors plus the global tensor being assembled.

With Hugging Face names (``--to hf``, or ``--names hf``) a Megatron-LM checkpoint becomes a model
directory transformers loads: ``LlamaForCausalLM`` for a Llama-style run (``hf_llama``),
``GPT2LMHeadModel`` for the standard GPT (``hf_gpt2``), with ``config.json`` from the saved args.

Every kind of committed checkpoint exports (``megatron_ext.locate``): Megatron-LM's
(``iter_*``, as above), DeepSpeed's (``global_step*``: the fp32 master weights consolidated
from the ZeRO 1-3 optimizer partitions, ``megatron_ext.deepspeed_export``), and the engine API's
(every tensor of the saved state under its key path).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.read.committed import CommittedCheckpoint, open_committed
from megatron_ext.megatron import hf_gpt2, hf_llama
from megatron_ext.megatron.checkpoint_layout import checkpoint_name, read_options, read_run_meta
from megatron_ext.megatron.shard_assembly import SavedShards

INDEX = "model.safetensors.index.json"
OPTIMIZER_PREFIX = "optimizer."
DTYPES = {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9 bytes (Hugging Face's convention: GB = 10**9, GiB = 2**30); the unit is required."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or not match.group(2):
        raise ValueError(f"size {text!r}: expected a number and a unit such as 500MB, 5GB or 2GiB "
                         "(a bare number is ambiguous; write 100B for bytes)")
    if match.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: unknown unit {match.group(2)!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def open_iteration(root: str, iteration: int | str) -> CommittedCheckpoint:
    """The committed checkpoint ``iter_NNNNNNN`` under a Megatron save directory (checksums verified on read)."""
    return open_committed(root, checkpoint_name(iteration), read_options())


def rank_zero_file(committed: CommittedCheckpoint) -> str:
    """The name of global rank 0's file (it holds ``common`` and ``meta``)."""
    zero = committed.files_of_rank(0)
    if not zero:
        raise CheckpointError(f"{committed.checkpoint} has no file of rank 0")
    return zero[0].name


def saved_meta(committed: CommittedCheckpoint) -> dict:
    """Rank 0's ``meta``: iteration, args, parallel layout, scheduler."""
    return read_run_meta(committed.reader(rank_zero_file(committed)))


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


def _file_mode() -> int:
    """The mode a new file gets from ``open`` under this process's umask (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_sharded(plan: list[hf_gpt2.OutputTensor], out: str, max_bytes: int, metadata: dict,
                  progress: Callable[[int, int], None] | None = None) -> dict:
    """Write the files and then the index; returns the index. ``progress(nbytes, files)`` as they are written."""
    files = group_into_files(plan, max_bytes)
    weight_map: dict[str, str] = {}
    mode = _file_mode()
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
            if progress is not None:
                progress(_nbytes(item), 0)
        path = os.path.join(out, file_name)
        save_file(tensors, path, metadata={"format": "pt"})
        os.chmod(path, mode)  # as the index and config: readable by whoever may read the directory
        if progress is not None:
            progress(0, 1)
    index = {"metadata": {"total_size": sum(_nbytes(i) for i in plan), **metadata}, "weight_map": weight_map}
    with open(os.path.join(out, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return index


def plan_bytes(plan: list[hf_gpt2.OutputTensor]) -> int:
    return sum(_nbytes(item) for item in plan)


def hf_plan(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], args: Any,
            read_layer: Callable[[str, int | None], torch.Tensor],
            dtype: torch.dtype | None) -> tuple[list[hf_gpt2.OutputTensor], dict]:
    """Hugging Face names for a Megatron GPT: ``LlamaForCausalLM`` for a Llama-style run (RMSNorm, SwiGLU or
    rotary embeddings: ``hf_llama`` says what else it needs), otherwise ``GPT2LMHeadModel``."""
    plan = hf_llama.plan_llama if hf_llama.is_llama_family(args) else hf_gpt2.plan_gpt2
    return plan(shapes, dtypes, args, read_layer, dtype)


def _tokenizer_note(args: Any, vocab_rows: int, saved_rows: int | None = None) -> dict:
    """What the export says about the vocabulary: Megatron pads it, and no tokenizer is exported."""
    get = (lambda name: getattr(args, name, None)) if args is not None else (lambda name: None)
    files = {k: get(k) for k in ("vocab_file", "merge_file", "tokenizer_model") if isinstance(get(k), str)}
    tokenizer = {"type": get("tokenizer_type"), **files}
    if saved_rows is not None and saved_rows > vocab_rows:
        rows = (f"vocab_size {vocab_rows} is the run's --vocab-size: the embedding's {saved_rows - vocab_rows} "
                "padding rows (--make-vocab-size-divisible-by x TP) are left out")
    else:
        rows = (f"vocab_size {vocab_rows} is the embedding's row count: Megatron-LM pads the tokenizer's vocabulary "
                "to a multiple of --make-vocab-size-divisible-by x TP, and the rows past the tokenizer's last id are "
                "padding that no token selects")
    note = (f"{rows}. No tokenizer is exported: copy the run's tokenizer files "
            + (f"({', '.join(files.values())}) " if files else "")
            + "into the output directory (or load the tokenizer separately) before using the model.")
    return {"vocab_size": vocab_rows, "tokenizer": tokenizer, "note": note}


def export_safetensors(source: Any, iteration: int | None = None, out: str | None = None, max_shard_size: str = "5GB",
                       dtype: str = "keep", names: str = "megatron", *, checkpoint: str | None = None,
                       progress: Any = None) -> dict[str, Any]:
    """Export the model weights of a committed checkpoint to ``out``; returns a summary.

    ``source`` is a ``megatron_ext.locate.Located``, or a path that ``locate.resolve`` takes with
    ``iteration``/``checkpoint`` (a root, or a checkpoint's own directory; the newest committed
    one when neither is given). ``progress`` is a ``megatron_ext.progress.Progress`` (or None).
    """
    from megatron_ext import locate

    if out is None:
        raise ValueError("export needs an output directory")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    if names not in ("megatron", "hf"):
        raise ValueError(f"--names {names!r}: choose megatron or hf")
    max_bytes = parse_size(max_shard_size)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out} exists and is not an empty directory; export writes into a new one")
    located = source if isinstance(source, locate.Located) else locate.resolve(source, iteration, checkpoint)
    if names == "hf" and located.kind != locate.MEGATRON:
        raise ValueError(f"Hugging Face names (--to hf, --names hf) map Megatron GPT weights; {located.path} is "
                         f"{locate.describe_kind(located.kind)}")
    committed = open_committed(located.root, located.name, read_options(), manifest=located.manifest)
    cast = DTYPES[dtype]
    config = None
    summary: dict[str, Any] = {"checkpoint": located.path, "kind": located.kind, "version": committed.version}
    if located.kind == locate.DEEPSPEED:
        from megatron_ext import deepspeed_export

        plan, info = deepspeed_export.plan(committed, cast)
        summary.update(info)
    elif located.kind == locate.ENGINE:
        plan = engine_plan(committed, cast)
    else:
        meta = saved_meta(committed)
        shards = SavedShards(committed)
        keys = model_keys(shards)
        summary.update(iteration=meta.get("iteration"), layout=meta.get("layout"))
        if names == "hf":
            def read_layer(key: str, layer: int | None) -> torch.Tensor:
                if layer is None:
                    return shards.read_global(key)
                shape = tuple(shards.global_shape(key))
                return shards.read_box(key, (layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:]).reshape(shape[1:])

            plan, config = hf_plan({k: tuple(shards.global_shape(k)) for k in keys},
                                   {k: shards.dtype(k) for k in keys}, meta.get("args"), read_layer, cast)
            summary.update(_tokenizer_note(meta.get("args"), config["vocab_size"],
                                           tuple(shards.global_shape(hf_llama.EMBEDDING))[0]),
                           architecture=config["architectures"][0])
        else:
            plan = megatron_plan(shards, keys, cast)
    if not plan:
        raise CheckpointError(f"{located.path} holds no model tensors to export")
    if progress is not None:
        progress.total_bytes = plan_bytes(plan)
        progress.total_files = len(group_into_files(plan, max_bytes))
    os.makedirs(out, exist_ok=True)
    if config is not None:
        with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    index = write_sharded(plan, out, max_bytes, {"iteration": str(summary.get("iteration", summary["version"])),
                                                  "names": names, "source_kind": located.kind},
                          progress.update if progress is not None else None)
    return {"out": out, **summary, "tensors": len(plan), "files": len(set(index["weight_map"].values())),
            "total_size": index["metadata"]["total_size"], "names": names}


# ------------------------------------------------------------------------------ engine API checkpoints
WEIGHT_PARTS = ("model", "module", "state_dict")


def engine_plan(committed: CommittedCheckpoint, dtype: torch.dtype | None) -> list[hf_gpt2.OutputTensor]:
    """Every tensor of every file's saved state, named by its key path (``0.weight``, ``encoder.layer.bias``).

    A state with a top-level ``model`` (or ``module``, ``state_dict``) holds its weights there and
    only that part is exported, under the names ``load_state_dict`` takes; otherwise the whole
    state. With several files (ranks), each name is prefixed by the file's (``rank00001/0.weight``):
    the engine does not know how the ranks' tensors would join.
    """
    plan: list[hf_gpt2.OutputTensor] = []
    files = committed.files()
    for file in files:
        reader = committed.reader(file.name)
        skeleton = reader.skeleton()
        part = next((k for k in WEIGHT_PARTS if type(skeleton) is dict and k in skeleton), None)
        for ref, tensor in committed.tensors(file.name).items():
            if part is not None and not ref.startswith(part + "/"):
                continue
            name = (ref[len(part) + 1:] if part is not None else ref).replace("/", ".")
            if len(files) > 1:
                name = f"{file.name}/{name}"
            out_dtype = dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype

            def produce(reader=reader, ref=ref, out_dtype=out_dtype) -> torch.Tensor:
                return reader.tensor(ref).to(out_dtype).contiguous()

            plan.append(hf_gpt2.OutputTensor(name, tensor.shape, out_dtype, produce))
    return plan
