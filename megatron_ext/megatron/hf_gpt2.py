"""Megatron GPT weights under Hugging Face GPT-2 names (``GPT2LMHeadModel``), where the layout allows.

Supported: the standard GPT of megatron-core's layer specs as the reference trainer builds it —
learned absolute positions, LayerNorm with biases, exact (erf) or tanh GeLU, multi-head attention
with one fused QKV projection, biases on every linear layer, tied or untied output layer. Anything
else (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, MoE, ...) is refused with the
reason, since renaming alone would not give an equivalent model.

Three differences besides the names:
* Megatron's fused QKV weight groups rows by head, ``[h0: q k v | h1: q k v | ...]``; GPT-2's
  ``c_attn`` holds all queries, then all keys, then all values ``[q | k | v]``.
* GPT-2's projections are ``Conv1D``: the weight is stored ``[in, out]``, the transpose of a
  ``Linear`` weight.
* GPT-2 defaults to the tanh approximation of GeLU (``gelu_new``); Megatron defaults to the exact
  one, so ``config.json`` says ``"activation_function": "gelu"`` unless the run used ``--openai-gelu``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

# Megatron's distributed-checkpoint key (layer-stacked: axis 0 is the layer) -> GPT-2 name and transform.
_PER_LAYER = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ("ln_1.weight", "copy"),
    "decoder.layers.self_attention.linear_qkv.layer_norm_bias": ("ln_1.bias", "copy"),
    "decoder.layers.self_attention.linear_qkv.weight": ("attn.c_attn.weight", "qkv_weight"),
    "decoder.layers.self_attention.linear_qkv.bias": ("attn.c_attn.bias", "qkv_bias"),
    "decoder.layers.self_attention.linear_proj.weight": ("attn.c_proj.weight", "transpose"),
    "decoder.layers.self_attention.linear_proj.bias": ("attn.c_proj.bias", "copy"),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": ("ln_2.weight", "copy"),
    "decoder.layers.mlp.linear_fc1.layer_norm_bias": ("ln_2.bias", "copy"),
    "decoder.layers.mlp.linear_fc1.weight": ("mlp.c_fc.weight", "transpose"),
    "decoder.layers.mlp.linear_fc1.bias": ("mlp.c_fc.bias", "copy"),
    "decoder.layers.mlp.linear_fc2.weight": ("mlp.c_proj.weight", "transpose"),
    "decoder.layers.mlp.linear_fc2.bias": ("mlp.c_proj.bias", "copy"),
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
}
_OUTPUT = "output_layer.weight"


class UnsupportedLayout(ValueError):
    """The saved model is not one that GPT-2's architecture computes identically."""


@dataclasses.dataclass(frozen=True)
class OutputTensor:
    """One tensor of the export: its name and shape, and how to produce it from the saved state."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


def _arg(args: Any, name: str, default: Any) -> Any:
    return getattr(args, name, default) if args is not None else default


def _check_args(args: Any) -> str:
    """Refuse what the weights' shapes cannot show; returns GPT-2's activation function name."""
    problems = []
    if _arg(args, "position_embedding_type", "learned_absolute") != "learned_absolute":
        problems.append(f"position embeddings {args.position_embedding_type!r} (GPT-2 has learned absolute ones)")
    if _arg(args, "normalization", "LayerNorm") != "LayerNorm":
        problems.append(f"normalization {args.normalization!r} (GPT-2 uses LayerNorm)")
    for flag in ("swiglu", "squared_relu", "qk_layernorm", "apply_residual_connection_post_layernorm",
                 "group_query_attention", "add_qkv_bias_only"):
        if _arg(args, flag, False):
            problems.append(f"--{flag.replace('_', '-')}")
    if _arg(args, "num_experts", None):
        problems.append("mixture of experts")
    if problems:
        raise UnsupportedLayout("cannot export as GPT-2: " + "; ".join(problems))
    return "gelu_new" if _arg(args, "openai_gelu", False) else "gelu"


def plan_gpt2(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], args: Any,
              read_layer: Callable[[str, int | None], torch.Tensor],
              dtype: torch.dtype | None) -> tuple[list[OutputTensor], dict]:
    """The GPT-2 tensors and ``config.json`` for a saved model with these (Megatron key -> global shape).

    ``read_layer(key, layer)`` returns the global tensor of ``key`` (``layer=None``) or its slice
    for one layer (axis 0 of layer-stacked keys). ``dtype`` casts every tensor (None keeps the saved one).
    """
    activation = _check_args(args)
    expected = set(_PER_LAYER) | set(_GLOBAL)
    missing = sorted(expected - set(shapes))
    extra = sorted(set(shapes) - expected - {_OUTPUT})
    if missing or extra:
        raise UnsupportedLayout("cannot export as GPT-2: the model's weights are not GPT-2's "
                                f"(missing {missing[:4]}, unexpected {extra[:4]}); RoPE, RMSNorm, "
                                "no biases or another layer spec change them")
    vocab, hidden = shapes["embedding.word_embeddings.weight"]
    positions = shapes["embedding.position_embeddings.weight"][0]
    layers, qkv_rows, _ = shapes["decoder.layers.self_attention.linear_qkv.weight"]
    _, ffn, _ = shapes["decoder.layers.mlp.linear_fc1.weight"]
    heads = _arg(args, "num_attention_heads", None)
    if heads is None:
        raise UnsupportedLayout("cannot export as GPT-2: the checkpoint's args do not give num_attention_heads")
    if qkv_rows != 3 * hidden or hidden % heads or _arg(args, "kv_channels", None) not in (None, hidden // heads):
        raise UnsupportedLayout(f"cannot export as GPT-2: QKV has {qkv_rows} rows for hidden size {hidden} and "
                                f"{heads} heads (grouped-query attention or kv_channels != hidden/heads)")
    if shapes["decoder.layers.mlp.linear_fc2.weight"][2] != ffn:
        raise UnsupportedLayout("cannot export as GPT-2: fc1 and fc2 disagree on the MLP width (gated MLP)")
    tied = _OUTPUT not in shapes
    head_dim = hidden // heads

    def transform(kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind == "qkv_weight":  # [heads, (q k v), head_dim, in] -> [(q k v), heads, head_dim, in] -> [in, 3h]
            tensor = tensor.reshape(heads, 3, head_dim, hidden).transpose(0, 1).reshape(3 * hidden, hidden).t()
        elif kind == "qkv_bias":
            tensor = tensor.reshape(heads, 3, head_dim).transpose(0, 1).reshape(3 * hidden)
        elif kind == "transpose":
            tensor = tensor.t()
        return tensor.contiguous() if dtype is None else tensor.to(dtype).contiguous()

    def out_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(reversed(shape)) if kind in ("qkv_weight", "transpose") else shape

    plan: list[OutputTensor] = []
    for key, name in _GLOBAL.items():
        plan.append(OutputTensor(name, tuple(shapes[key]), dtype or dtypes[key],
                                 lambda key=key: transform("copy", read_layer(key, None))))
    for layer in range(layers):
        for key, (suffix, kind) in _PER_LAYER.items():
            plan.append(OutputTensor(f"transformer.h.{layer}.{suffix}", out_shape(kind, tuple(shapes[key][1:])),
                                     dtype or dtypes[key],
                                     lambda key=key, layer=layer, kind=kind: transform(kind, read_layer(key, layer))))
    if not tied:
        plan.append(OutputTensor("lm_head.weight", tuple(shapes[_OUTPUT]), dtype or dtypes[_OUTPUT],
                                 lambda: transform("copy", read_layer(_OUTPUT, None))))
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": positions,
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "n_inner": ffn,
        "activation_function": activation,
        "layer_norm_epsilon": _arg(args, "layernorm_epsilon", 1e-5),
        "resid_pdrop": _arg(args, "hidden_dropout", 0.1),
        "embd_pdrop": _arg(args, "hidden_dropout", 0.1),
        "attn_pdrop": _arg(args, "attention_dropout", 0.1),
        "scale_attn_weights": True,
        "tie_word_embeddings": tied,
        "bos_token_id": None,  # GPT-2's 50256 would lie outside another vocabulary
        "eos_token_id": None,
        "torch_dtype": str(dtype or dtypes["embedding.word_embeddings.weight"]).removeprefix("torch."),
    }
    return plan, config
