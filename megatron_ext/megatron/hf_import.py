"""``megatron-ext convert HF_DIR --to datastates OUT --tp T --pp P``: a Hugging Face Llama as a datastates checkpoint.

The result is a committed ``release`` checkpoint (the tracker says ``release``), as Megatron-LM's
own converters name imported weights: model weights only, no optimizer state, RNG or counters, so
``pretrain_gpt.py --use-datastates --load OUT`` starts a fine-tune from it at iteration 0 (with
``--finetune`` or without). Each rank's file holds the shards that rank of a T x P x D run saves
(``hf_llama`` for how the tensors map), written by the engine's ``OfflineWriter`` one rank after
the other, reading one layer of the Hugging Face files at a time.

Rank 0's meta records the model's Megatron arguments (``hf_llama.saved_args``) and where it came
from (``hf_llama.IMPORTED``): the load then refuses a run whose arguments build another model
(``loading``), by name, instead of a wrong model where the shapes happen to agree (rotary base,
norm epsilon).

Only data is read from the directory: ``config.json`` as JSON and the weights as safetensors
(headers checked against the config before any tensor is read); pickled weights
(``pytorch_model.bin``) are refused, since unpickling runs code, and nothing is imported from
the directory (no ``trust_remote_code``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megatron_ext.engine import CheckpointError
from megatron_ext.megatron import checkpoint_layout as ckpt_layout
from megatron_ext.megatron import hf_llama
from megatron_ext.megatron.safe_classes import megatron_safe_classes

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: Buffers older transformers saved with the weights; recomputed from the config, never read.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def is_hf_directory(path: str) -> bool:
    """A Hugging Face model directory: a ``config.json`` and no megatron-core ``metadata.json``."""
    return os.path.isfile(os.path.join(path, CONFIG)) and not os.path.isfile(os.path.join(path, "metadata.json"))


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if os.path.islink(path):
        raise CheckpointError(f"{path}: a symbolic link; the importer reads this directory's own files only")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a Hugging Face model directory has one") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


class HfWeights:
    """Where each tensor of a Hugging Face directory is, with its shape and dtype, from the safetensors headers."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.directory = directory
        index_path, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
        if os.path.isfile(index_path):
            files = self._index_files(index_path)
        elif os.path.isfile(single):
            files = {SINGLE: None}
        else:
            pickled = sorted(n for n in os.listdir(directory) if n.endswith(PICKLED))
            if pickled:
                raise CheckpointError(f"{os.path.join(directory, pickled[0])}: pickled weights are not read (loading "
                                      "a pickle runs code); save the model with safetensors (save_pretrained's "
                                      "default) and convert that")
            raise CheckpointError(f"{directory}: no {INDEX} and no {SINGLE}: no safetensors weights to import")
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for name, listed in files.items():
            path = os.path.join(directory, name)
            if os.path.islink(path):  # the directory's own files only: a link could lead anywhere
                raise CheckpointError(f"{path}: a symbolic link; the importer reads this directory's own files only")
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing; {INDEX} lists it for {len(listed or ())} tensor(s)")
            try:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        dtype = piece.get_dtype()
                        if dtype not in _DTYPES:
                            raise CheckpointError(f"{path}: {key} is {dtype}; the importer takes F32, F16 and BF16")
                        self.where[key], self.shapes[key] = name, tuple(piece.get_shape())
                        self.dtypes[key] = _DTYPES[dtype]
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors' own errors name no file
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
            for key in listed or ():
                if self.where.get(key) != name:
                    raise CheckpointError(f"{path}: has no tensor {key}, which {INDEX} places there")

    def _index_files(self, index_path: str) -> dict[str, list[str]]:
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{index_path}: not a readable index ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
                raise CheckpointError(f"{index_path}: {key} is placed in {name!r}, not a file of this directory")
            files.setdefault(name, []).append(key)
        return files

    def check(self, expected: dict[str, tuple[int, ...]]) -> torch.dtype:
        """Every tensor the config's model has, of its shape, and no other; returns their one dtype."""
        for key, shape in expected.items():
            if key not in self.shapes:
                raise CheckpointError(f"{self._file_hint()}: no tensor {key}, which the {hf_llama.ARCHITECTURE} of "
                                      f"{CONFIG} has")
            if self.shapes[key] != shape:
                raise CheckpointError(f"{os.path.join(self.directory, self.where[key])}: {key} has shape "
                                      f"{list(self.shapes[key])}; the model of {CONFIG} needs {list(shape)}")
        extra = sorted(k for k in self.shapes if k not in expected and not k.endswith(IGNORED_SUFFIXES))
        if extra:
            raise CheckpointError(f"{os.path.join(self.directory, self.where[extra[0]])}: {extra[0]} is not a tensor "
                                  f"of the {hf_llama.ARCHITECTURE} of {CONFIG} ({len(extra)} such; biases, experts "
                                  "or another architecture)")
        dtypes = {self.dtypes[k] for k in expected}
        if len(dtypes) > 1:
            raise CheckpointError(f"{self.directory}: tensors of several dtypes ({sorted(map(str, dtypes))}); the "
                                  "importer takes one")
        return dtypes.pop()

    def _file_hint(self) -> str:
        index = os.path.join(self.directory, INDEX)
        return index if os.path.isfile(index) else os.path.join(self.directory, SINGLE)

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(os.path.join(self.directory, self.where[key]), framework="pt") as f:
            return f.get_tensor(key)


def _box(shards: dict, key: str, data: torch.Tensor, global_shape: tuple, offset: tuple, fragments: list,
         prepend: int) -> None:
    """One shard as the adapter's save records it (``sharding.shard_meta``)."""
    sid = f"{key}@{','.join(str(o) for o in offset)}"
    shards["tensors"][sid] = data.contiguous()
    shards["meta"][sid] = {"key": key, "global_shape": list(global_shape), "global_offset": list(offset),
                           "local_shape": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                           "axis_fragmentations": fragments, "prepend_axis_num": prepend}


def rank_shards(weights: HfWeights, shape: hf_llama.LlamaShape, tp: int, pp: int, tp_rank: int, pp_rank: int,
                rows: int) -> dict:
    """The shards (``tensors``, ``objects``, ``meta``) rank (tp_rank, pp_rank) of a TP x PP run saves."""
    shards: dict[str, dict] = {"tensors": {}, "objects": {}, "meta": {}}
    layers, hidden, d = shape.layers, shape.hidden, shape.head_dim
    per_stage = layers // pp
    qkv_rows, attn, ffn = shape.qkv_rows // tp, shape.heads * d // tp, shape.ffn // tp
    vocab_rows = rows // tp
    for n in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        hf = {name: weights.read(f"model.layers.{n}.{name}") for name in hf_llama.HF_LAYER}
        mg = hf_llama.megatron_layer(hf, shape)

        def layer_box(key: str, data: torch.Tensor, offset: tuple, fragments: list) -> None:
            _box(shards, key, data, (layers, *mg[key].shape), (n, *offset), [layers, *fragments], 1)

        t = tp_rank
        layer_box(hf_llama.QKV, mg[hf_llama.QKV][t * qkv_rows:(t + 1) * qkv_rows], (t * qkv_rows, 0), [tp, 1])
        layer_box(hf_llama.PROJ, mg[hf_llama.PROJ][:, t * attn:(t + 1) * attn], (0, t * attn), [1, tp])
        fc1 = mg[hf_llama.FC1]  # [gate; up]: each rank saves its slice of both (megatron-core's swiglu factory)
        layer_box(hf_llama.FC1, fc1[t * ffn:(t + 1) * ffn], (t * ffn, 0), [2 * tp, 1])
        layer_box(hf_llama.FC1, fc1[shape.ffn + t * ffn:shape.ffn + (t + 1) * ffn], (shape.ffn + t * ffn, 0), [2 * tp, 1])
        layer_box(hf_llama.FC2, mg[hf_llama.FC2][:, t * ffn:(t + 1) * ffn], (0, t * ffn), [1, tp])
        if tp_rank == 0:  # replicated over tensor parallelism: saved once
            layer_box(hf_llama.NORM_1, mg[hf_llama.NORM_1], (0,), [1])
            layer_box(hf_llama.NORM_2, mg[hf_llama.NORM_2], (0,), [1])
            for module in hf_llama.EXTRA_STATE_MODULES:
                key = f"decoder.layers.{module}._extra_state"
                sid = f"{key}@{n}"
                shards["objects"][sid] = None  # megatron-core's local layers hold no extra state
                shards["meta"][sid] = {"key": key, "global_shape": [layers], "global_offset": [n]}

    def vocab_box(key: str, hf_name: str) -> None:
        padded = hf_llama.pad_rows(weights.read(hf_name), rows)
        _box(shards, key, padded[tp_rank * vocab_rows:(tp_rank + 1) * vocab_rows], (rows, hidden),
             (tp_rank * vocab_rows, 0), [tp, 1], 0)

    if pp_rank == 0:
        vocab_box(hf_llama.EMBEDDING, hf_llama.HF_EMBEDDING)
    if pp_rank == pp - 1:
        if tp_rank == 0:
            _box(shards, hf_llama.FINAL_NORM, weights.read(hf_llama.HF_NORM), (hidden,), (0,), [1], 0)
        if not shape.tied:
            vocab_box(hf_llama.OUTPUT, hf_llama.HF_HEAD)
        # Tied: the last stage's output layer is a replica of the first stage's embedding, not saved.
    return shards


def _check_layout(shape: hf_llama.LlamaShape, tp: int, pp: int, dp: int, config_path: str) -> None:
    problems = []
    for what, value in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if type(value) is not int or value < 1:
            problems.append(f"{what} {value!r} is not a positive whole number")
    if problems:
        raise ValueError("; ".join(problems))
    if shape.groups % tp or shape.heads % tp:
        problems.append(f"TP {tp} does not divide {shape.heads} heads and {shape.groups} key/value heads")
    if shape.ffn % tp:
        problems.append(f"TP {tp} does not divide intermediate_size {shape.ffn}")
    if shape.layers % pp:
        problems.append(f"PP {pp} does not divide num_hidden_layers {shape.layers}")
    if problems:
        raise CheckpointError(f"{config_path}: the model cannot be laid out so: " + "; ".join(problems))


def import_hf(source: str, out: str, tp: int = 1, pp: int = 1, dp: int = 1, divisible_by: int = 128,
              chunk_mb: float = 16.0, progress: Any = None) -> dict[str, Any]:
    """Write the Hugging Face ``LlamaForCausalLM`` in ``source`` as a committed datastates checkpoint in ``out``
    for a TP x PP x DP run (``divisible_by``: Megatron-LM's ``--make-vocab-size-divisible-by``)."""
    from megatron_ext.engine.save.offline_writer import OfflineWriter

    config_path = os.path.join(source, CONFIG)
    config = read_config(source)
    try:
        shape = hf_llama.shape_from_hf(config)
    except hf_llama.ConfigRefused as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    _check_layout(shape, tp, pp, dp, config_path)
    if type(divisible_by) is not int or divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by {divisible_by!r} is not a positive whole number")
    weights = HfWeights(source)
    dtype = weights.check(shape.hf_shapes())
    rows = hf_llama.padded_rows(shape.vocab, divisible_by, tp)
    name = ckpt_layout.checkpoint_name(ckpt_layout.RELEASE)
    target = ckpt_layout.new_checkpoint_dir(out, ckpt_layout.RELEASE)
    world = tp * pp * dp
    args = hf_llama.saved_args(shape, tp, pp, dp, divisible_by, dtype)
    if progress is not None:
        progress.total_files = world
    writer_config = {"chunk_size_mb": chunk_mb, "safe_classes": list(megatron_safe_classes())}
    with OfflineWriter(writer_config, out, name, world_size=world, version=0) as writer:
        for rank in range(world):
            coords = {"tp_rank": rank % tp, "dp_rank": (rank // tp) % dp, "pp_rank": rank // (tp * dp)}
            layout = {"world_size": world, "tp": tp, "pp": pp, "dp": dp, **coords}
            shards = (rank_shards(weights, shape, tp, pp, coords["tp_rank"], coords["pp_rank"], rows)
                      if coords["dp_rank"] == 0 else {"tensors": {}, "objects": {}, "meta": {}})
            meta = None
            if rank == 0:
                meta = ckpt_layout.run_meta(0, 0, None, args, layout)
                meta[hf_llama.IMPORTED] = {"format": "hf", "architecture": hf_llama.ARCHITECTURE,
                                           "directory": os.path.abspath(source)}
            state = ckpt_layout.rank_state(shards, common={} if rank == 0 else None, meta=meta)
            writer.save(rank, state, ckpt_layout.rank_file_name(rank),
                        extra=ckpt_layout.rank_extra(shards["objects"], layout))
            if progress is not None:
                progress.update(sum(t.numel() * t.element_size() for t in shards["tensors"].values()), 1)
        writer.commit(on_committed=ckpt_layout.tracker_writer(out, ckpt_layout.RELEASE, 0))
    return {"source": source, "out": target, "iteration": ckpt_layout.RELEASE, "ranks": world,
            "layout": {"tp": tp, "pp": pp, "dp": dp}, "architecture": hf_llama.ARCHITECTURE,
            "padded_vocab_size": rows, "dtype": str(dtype).removeprefix("torch."),
            "optimizer_format": None, "megatron_args": " ".join(shape.megatron_flags())}
