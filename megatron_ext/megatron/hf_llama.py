"""Megatron GPT weights of a Llama-family model under Hugging Face ``LlamaForCausalLM`` names, both ways.

Supported: what ``--swiglu --normalization RMSNorm --position-embedding-type rope
--disable-bias-linear`` builds with megatron-core's layer specs (the model Llama 2 and 3 are):
multi-head or grouped-query attention, rotary embeddings in the rotate-half convention (not
``--rotary-interleaved``), optionally with Llama 3's frequency scaling (``--use-rope-scaling``),
tied or untied output layer. Anything else (MoE, biases, QK norm, partial or interleaved rotary,
sliding windows, multi-latent attention, ...) is refused with the reason: renaming alone would not
give an equivalent model.

The differences besides the names, each checked by the tests against transformers' own forward:

* Megatron's fused QKV weight groups rows per query group, ``[g0: q_0 .. q_{n-1} k v | g1: ...]``
  (``n`` = heads / groups); Llama keeps ``q_proj``, ``k_proj``, ``v_proj`` apart, query head
  ``g * n + i`` attending with key/value head ``g`` (transformers' ``repeat_kv``), which is the
  order the groups give when q, k and v are cut out of each group.
* The SwiGLU ``fc1`` holds ``[gate; up]`` as one global tensor: every tensor-parallel rank saves
  its ``[gate_shard; up_shard]`` as two boxes of it (megatron-core's swiglu sharded factory), so
  the assembled tensor is all of gate, then all of up, whatever TP wrote it.
* Megatron pads the vocabulary (``--make-vocab-size-divisible-by`` x TP); the export keeps the
  tokenizer's rows only (the saved ``--vocab-size`` when there is one), the import pads again
  with zero rows.
* Rotary embeddings need no permutation: Megatron's non-interleaved rotary rotates the two halves
  of each head, as transformers' ``rotate_half`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable

import torch

from megatron_ext.megatron.hf_gpt2 import OutputTensor, UnsupportedLayout

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
#: Rank 0's meta records an imported model under this key (the HF directory, its architecture).
IMPORTED = "imported_from"

# Megatron's distributed-checkpoint keys. Per layer (layer-stacked: axis 0 is the layer).
QKV = "decoder.layers.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
NORM_1 = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
NORM_2 = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
PER_LAYER = (NORM_1, QKV, PROJ, NORM_2, FC1, FC2)
# Whole-model keys.
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
#: The layer modules whose (empty) extra state megatron-core saves as objects, one per layer.
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")

# Hugging Face names of one layer's tensors.
HF_LAYER = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
HF_EMBEDDING, HF_NORM, HF_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"

# Megatron's rope scaling (``--use-rope-scaling``): Llama 3's, with these fixed constants.
LLAMA3_LOW_FREQ, LLAMA3_HIGH_FREQ, LLAMA3_ORIGINAL_POSITIONS = 1.0, 4.0, 8192


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Everything both sides must agree on: the model, not its layout."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int  # the tokenizer's rows (no padding)
    max_positions: int
    rope_theta: int
    rope_scaling: float | None  # Llama 3's factor, None without scaling
    eps: float
    tied: bool

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim

    def megatron_args(self) -> dict[str, Any]:
        """The Megatron-LM arguments (``args`` attribute names) that build this model."""
        return {
            "num_layers": self.layers, "hidden_size": self.hidden, "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads, "group_query_attention": self.groups != self.heads,
            "num_query_groups": self.groups, "kv_channels": self.head_dim, "swiglu": True,
            "normalization": "RMSNorm", "layernorm_epsilon": self.eps, "position_embedding_type": "rope",
            "rotary_base": self.rope_theta, "rotary_percent": 1.0, "rotary_interleaved": False,
            "use_rope_scaling": self.rope_scaling is not None,
            "rope_scaling_factor": self.rope_scaling if self.rope_scaling is not None else 8.0,
            "untie_embeddings_and_output_weights": not self.tied, "add_bias_linear": False,
            "add_qkv_bias": False, "qk_layernorm": False, "num_experts": None,
            "max_position_embeddings": self.max_positions, "add_position_embedding": False,
        }

    def megatron_flags(self) -> list[str]:
        """The same as ``pretrain_gpt.py`` command-line flags."""
        flags = ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                 "--ffn-hidden-size", str(self.ffn), "--num-attention-heads", str(self.heads)]
        if self.groups != self.heads:
            flags += ["--group-query-attention", "--num-query-groups", str(self.groups)]
        if self.head_dim != self.hidden // self.heads:
            flags += ["--kv-channels", str(self.head_dim)]
        flags += ["--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", repr(self.eps),
                  "--position-embedding-type", "rope", "--rotary-base", str(self.rope_theta),
                  "--disable-bias-linear", "--max-position-embeddings", str(self.max_positions)]
        if self.rope_scaling is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling)]
        if not self.tied:
            flags.append("--untie-embeddings-and-output-weights")
        return flags

    def hf_config(self, dtype: torch.dtype, initializer_range: float = 0.02) -> dict:
        """``config.json`` of the ``LlamaForCausalLM`` (transformers 4.x and 5.x read it)."""
        rope = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": float(self.rope_theta), "factor": self.rope_scaling,
                    "low_freq_factor": LLAMA3_LOW_FREQ, "high_freq_factor": LLAMA3_HIGH_FREQ,
                    "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS}
        config = {
            "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups, "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_positions, "rms_norm_eps": self.eps,
            "rope_theta": float(self.rope_theta), "rope_parameters": rope,
            "tie_word_embeddings": self.tied, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "initializer_range": initializer_range, "use_cache": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,  # no tokenizer is exported
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if self.rope_scaling is not None:  # transformers 4.x's name
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return config

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the ``LlamaForCausalLM`` and its shape."""
        h, d = self.hidden, self.head_dim
        layer = dict(zip(HF_LAYER, [(h,), (self.heads * d, h), (self.groups * d, h), (self.groups * d, h),
                                    (h, self.heads * d), (h,), (self.ffn, h), (self.ffn, h), (h, self.ffn)]))
        shapes = {HF_EMBEDDING: (self.vocab, h), HF_NORM: (h,)}
        for n in range(self.layers):
            shapes.update({f"model.layers.{n}.{name}": shape for name, shape in layer.items()})
        if not self.tied:
            shapes[HF_HEAD] = (self.vocab, h)
        return shapes


def _arg(args: Any, name: str, default: Any) -> Any:
    value = getattr(args, name, default) if args is not None else default
    return default if value is None and default is not None else value


def is_llama_family(args: Any) -> bool:
    """Whether the saved run is meant to be a Llama-style model (then ``plan_llama`` maps it, or says why not)."""
    return (_arg(args, "normalization", "LayerNorm") == "RMSNorm" or bool(_arg(args, "swiglu", False))
            or _arg(args, "position_embedding_type", "learned_absolute") == "rope")


# What a Llama model does not have, by Megatron argument: (argument, the value Llama needs, why).
_MUST_BE = (
    ("normalization", "RMSNorm", "Llama uses RMSNorm"),
    ("swiglu", True, "Llama's MLP is SwiGLU (--swiglu)"),
    ("position_embedding_type", "rope", "Llama uses rotary embeddings (--position-embedding-type rope)"),
    ("add_bias_linear", False, "Llama's linear layers have no biases (--disable-bias-linear)"),
    ("add_qkv_bias", False, "no QKV biases in Llama"),
    ("qk_layernorm", False, "no QK normalization in Llama"),
    ("qk_l2_norm", False, "no QK normalization in Llama"),
    ("rotary_interleaved", False, "--rotary-interleaved pairs other channels than Llama's rotate-half"),
    ("rotary_percent", 1.0, "Llama rotates the whole head (--rotary-percent 1.0)"),
    ("rotary_seq_len_interpolation_factor", None, "linear position interpolation"),
    ("apply_residual_connection_post_layernorm", False, "post-layernorm residuals"),
    ("layernorm_zero_centered_gamma", False, "zero-centred norm weights"),
    ("multi_latent_attention", False, "multi-latent attention"),
    ("num_experts", None, "mixture of experts (LlamaForCausalLM has one dense MLP per layer)"),
    ("mtp_num_layers", None, "multi-token prediction layers"),
    ("window_size", None, "sliding-window attention"),
    ("softmax_type", "vanilla", "an attention softmax other than the plain one"),
    ("attention_output_gate", False, "gated attention output"),
    ("experimental_attention_variant", None, "an experimental attention variant"),
    ("heterogeneous_layers_config_path", None, "heterogeneous layers"),
    ("use_mup", False, "muP scaling"),
    ("no_rope_freq", None, "layers without rotary embeddings"),
    ("squared_relu", False, "squared ReLU"),
)


#: Megatron-LM's flag of an argument where it is not the attribute's name.
_FLAGS = {"layernorm_epsilon": "--norm-epsilon", "add_bias_linear": "bias on linear layers (--disable-bias-linear "
          "off)", "padded_vocab_size": "padded vocabulary (--make-vocab-size-divisible-by x TP)",
          "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}


def _flag(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _problems(args: Any) -> list[str]:
    problems = []
    for name, wanted, why in _MUST_BE:
        have = getattr(args, name, wanted) if args is not None else wanted
        if have != wanted and not (wanted is None and have in (None, 0, False)):
            problems.append(f"{_flag(name)} {have!r}: {why}")
    if getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None):
        problems.append("a hybrid (Mamba) model")
    scale = getattr(args, "softmax_scale", None)
    if scale is not None:
        problems.append(f"--softmax-scale {scale}: Llama scales attention by 1/sqrt(head_dim)")
    return problems


def shape_from_megatron(shapes: dict[str, tuple[int, ...]], args: Any) -> LlamaShape:
    """The Llama model a saved run is (Megatron key -> global shape, and its args), or ``UnsupportedLayout``."""
    if args is None:
        raise UnsupportedLayout("cannot export as Llama: the checkpoint records no arguments (heads, groups, "
                                "rotary base, norm epsilon are not in the weights' shapes)")
    problems = _problems(args)
    expected = set(PER_LAYER) | {EMBEDDING, FINAL_NORM}
    missing = sorted(expected - set(shapes))
    extra = sorted(set(shapes) - expected - {OUTPUT})
    if missing or extra:
        problems.append(f"the model's weights are not Llama's (missing {missing[:4]}, unexpected {extra[:4]})")
    if problems:
        raise UnsupportedLayout("cannot export as Llama: " + "; ".join(problems))
    rows, hidden = shapes[EMBEDDING]
    layers, qkv_rows, _ = shapes[QKV]
    heads = _arg(args, "num_attention_heads", None)
    groups = _arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention", False) else heads
    head_dim = _arg(args, "kv_channels", None) or (hidden // heads if heads else None)
    if not heads or not groups or heads % groups or qkv_rows != (heads + 2 * groups) * head_dim:
        raise UnsupportedLayout(f"cannot export as Llama: QKV has {qkv_rows} rows, which {heads} heads, {groups} "
                                f"query groups and head size {head_dim} do not give")
    ffn = shapes[FC1][1] // 2
    if shapes[FC1][1] % 2 or shapes[FC2][2] != ffn:
        raise UnsupportedLayout(f"cannot export as Llama: fc1 has {shapes[FC1][1]} rows and fc2 {shapes[FC2][2]} "
                                "columns, not the [gate; up] pair of one MLP width")
    tied = OUTPUT not in shapes
    if not tied and tuple(shapes[OUTPUT]) != (rows, hidden):
        raise UnsupportedLayout(f"cannot export as Llama: output layer {shapes[OUTPUT]} vs embedding {(rows, hidden)}")
    vocab = _arg(args, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and 0 < vocab <= rows else rows
    theta = _arg(args, "rotary_base", 10000)
    return LlamaShape(layers=layers, hidden=hidden, heads=heads, groups=groups, head_dim=head_dim, ffn=ffn,
                      vocab=vocab, max_positions=_arg(args, "max_position_embeddings", None) or _arg(args, "seq_length", 2048),
                      rope_theta=int(theta),
                      rope_scaling=float(_arg(args, "rope_scaling_factor", 8.0)) if _arg(args, "use_rope_scaling", False) else None,
                      eps=float(_arg(args, "layernorm_epsilon", 1e-5)), tied=tied)


# ---------------------------------------------------------------------------- the tensors, both ways
def split_qkv(qkv: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's fused QKV ``[groups x (n q, k, v) x head_dim, hidden]`` -> q, k, v as Llama holds them."""
    per_group = shape.heads // shape.groups
    grouped = qkv.reshape(shape.groups, per_group + 2, shape.head_dim, qkv.shape[-1])
    q = grouped[:, :per_group].reshape(shape.heads * shape.head_dim, -1)
    k = grouped[:, per_group].reshape(shape.groups * shape.head_dim, -1)
    v = grouped[:, per_group + 1].reshape(shape.groups * shape.head_dim, -1)
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    """The inverse of ``split_qkv``."""
    per_group, d = shape.heads // shape.groups, shape.head_dim
    hidden = q.shape[-1]
    parts = (q.reshape(shape.groups, per_group, d, hidden), k.reshape(shape.groups, 1, d, hidden),
             v.reshape(shape.groups, 1, d, hidden))
    return torch.cat(parts, dim=1).reshape(shape.qkv_rows, hidden)


def padded_rows(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by`` x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def plan_llama(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], args: Any,
               read_layer: Callable[[str, int | None], torch.Tensor],
               dtype: torch.dtype | None) -> tuple[list[OutputTensor], dict]:
    """The ``LlamaForCausalLM`` tensors and ``config.json`` for a saved model, as ``hf_gpt2.plan_gpt2``."""
    shape = shape_from_megatron(shapes, args)

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return (tensor if dtype is None else tensor.to(dtype)).contiguous()

    def out(name: str, key: str, produce: Callable[[], torch.Tensor], tensor_shape: tuple[int, ...]) -> OutputTensor:
        return OutputTensor(name, tensor_shape, dtype or dtypes[key], lambda: cast(produce()))

    hf = shape.hf_shapes()
    plan = [out(HF_EMBEDDING, EMBEDDING, lambda: read_layer(EMBEDDING, None)[:shape.vocab], hf[HF_EMBEDDING])]
    for n in range(shape.layers):
        prefix = f"model.layers.{n}."

        def qkv_part(index: int, n: int = n) -> torch.Tensor:
            return split_qkv(read_layer(QKV, n), shape)[index]

        pieces = (  # every lambda binds this layer's number (and function) now, not the loop's last
            (NORM_1, lambda n=n: read_layer(NORM_1, n)), (QKV, lambda part=qkv_part: part(0)),
            (QKV, lambda part=qkv_part: part(1)), (QKV, lambda part=qkv_part: part(2)),
            (PROJ, lambda n=n: read_layer(PROJ, n)),
            (NORM_2, lambda n=n: read_layer(NORM_2, n)), (FC1, lambda n=n: read_layer(FC1, n)[:shape.ffn]),
            (FC1, lambda n=n: read_layer(FC1, n)[shape.ffn:]), (FC2, lambda n=n: read_layer(FC2, n)),
        )
        for name, (key, produce) in zip(HF_LAYER, pieces):
            plan.append(out(prefix + name, key, produce, hf[prefix + name]))
    plan.append(out(HF_NORM, FINAL_NORM, lambda: read_layer(FINAL_NORM, None), hf[HF_NORM]))
    if not shape.tied:
        plan.append(out(HF_HEAD, OUTPUT, lambda: read_layer(OUTPUT, None)[:shape.vocab], hf[HF_HEAD]))
    config = shape.hf_config(dtype or dtypes[EMBEDDING], float(_arg(args, "init_method_std", 0.02)))
    return plan, config


# ---------------------------------------------------------------------------- a Hugging Face config
class ConfigRefused(ValueError):
    """A Hugging Face config that is not a ``LlamaForCausalLM`` this mapping expresses."""


def shape_from_hf(config: dict) -> LlamaShape:
    """The model a ``LlamaForCausalLM`` ``config.json`` describes, or ``ConfigRefused`` naming what is not mapped."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if archs != [ARCHITECTURE] or model_type != MODEL_TYPE:
        raise ConfigRefused(f"architecture {archs!r} (model_type {model_type!r}) is not one the importer maps: it "
                            f"takes {ARCHITECTURE} (model_type {MODEL_TYPE!r})")

    def whole(name: str, default: Any = None) -> int:
        value = config.get(name, default)
        if type(value) is not int or value < 1:
            raise ConfigRefused(f"{name} {value!r} is not a positive whole number")
        return value

    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r} (Megatron's --swiglu is SiLU-gated)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            problems.append(f"{flag} true (Megatron's Llama has no biases)")
    rope = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0 or float(theta) != int(theta):
        problems.append(f"rope_theta {theta!r} (Megatron's --rotary-base is a whole number)")
    scaling = None
    if rope_type == "llama3":
        source = {**legacy, **rope}
        constants = (source.get("low_freq_factor"), source.get("high_freq_factor"),
                     source.get("original_max_position_embeddings"))
        if tuple(map(float, (c or 0 for c in constants))) != (LLAMA3_LOW_FREQ, LLAMA3_HIGH_FREQ,
                                                               float(LLAMA3_ORIGINAL_POSITIONS)):
            problems.append(f"llama3 rope scaling with low/high frequency factors and original positions {constants}"
                            f" (Megatron's --use-rope-scaling fixes them at 1, 4, 8192)")
        scaling = float(source.get("factor", 8.0))
    elif rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (Megatron expresses default and llama3 rotary embeddings)")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {config['partial_rotary_factor']}")
    if problems:
        raise ConfigRefused("not expressible in Megatron: " + "; ".join(problems))
    hidden, heads = whole("hidden_size"), whole("num_attention_heads")
    groups = whole("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    if heads % groups:
        raise ConfigRefused(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    eps = config.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigRefused(f"rms_norm_eps {eps!r} is not a positive number")
    return LlamaShape(layers=whole("num_hidden_layers"), hidden=hidden, heads=heads, groups=groups,
                      head_dim=whole("head_dim", head_dim), ffn=whole("intermediate_size"), vocab=whole("vocab_size"),
                      max_positions=whole("max_position_embeddings", 2048), rope_theta=int(theta),
                      rope_scaling=scaling, eps=float(eps), tied=bool(config.get("tie_word_embeddings", False)))


def megatron_layer(hf: dict[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """One layer's Megatron tensors (per-layer keys) from its Llama tensors (``HF_LAYER`` names)."""
    return {
        NORM_1: hf["input_layernorm.weight"],
        QKV: fuse_qkv(hf["self_attn.q_proj.weight"], hf["self_attn.k_proj.weight"], hf["self_attn.v_proj.weight"], shape),
        PROJ: hf["self_attn.o_proj.weight"],
        NORM_2: hf["post_attention_layernorm.weight"],
        FC1: torch.cat([hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"]]),
        FC2: hf["mlp.down_proj.weight"],
    }


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary rows padded with zeros to Megatron's ``rows``."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def saved_args(shape: LlamaShape, tp: int, pp: int, dp: int, divisible_by: int, dtype: torch.dtype) -> argparse.Namespace:
    """The Megatron arguments an imported checkpoint records (what ``export`` and the load's check read)."""
    return argparse.Namespace(
        **shape.megatron_args(), vocab_size=shape.vocab, padded_vocab_size=padded_rows(shape.vocab, divisible_by, tp),
        make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=dp, world_size=tp * pp * dp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
        iteration=0)


def _effective(args: Any, name: str) -> Any:
    """An argument as the model uses it (Megatron fills some in ``validate_args``)."""
    if name == "num_query_groups":
        return args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    if name == "kv_channels":
        return getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    if name == "group_query_attention":
        return _effective(args, "num_query_groups") != args.num_attention_heads
    if name == "rope_scaling_factor" and not getattr(args, "use_rope_scaling", False):
        return None
    if name == "num_experts":
        return getattr(args, "num_experts", None) or None
    return getattr(args, name, None)


#: What an imported checkpoint's args and the run's must agree on (the weights' shapes do not show all).
CHECKED_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "swiglu", "normalization", "layernorm_epsilon", "position_embedding_type",
                "rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
                "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                "num_experts", "padded_vocab_size")


def argument_mismatches(saved: Any, args: Any) -> list[str]:
    """``--flag run-value (the model: saved-value)`` for every model argument the run sets otherwise."""
    problems = []
    for name in CHECKED_ARGS:
        mine, theirs = _effective(args, name), _effective(saved, name)
        if mine != theirs:
            problems.append(f"{_flag(name)} {mine!r} (the model: {theirs!r})")
    return problems
