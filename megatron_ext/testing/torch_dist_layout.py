"""A megatron-core ``torch_dist`` checkpoint in any TP x PP x DP layout, written from one process.

    python -m megatron_ext.testing.torch_dist_layout OUT --tp 4 --pp 5 --dp 9 [--hidden 256 ...]

Why: ``megatron-ext convert --to datastates`` spreads a checkpoint over as many rank files as the
run had ranks, so its behaviour at the 180-GPU template's layout (TP=4 x PP=5 x DP=9) is what
must be tested, and training 180 ranks on this machine is out of reach. megatron-core's own
``dist_checkpointing.save`` accepts, from a gloo world of one, every shard the ranks of a layout
would write (each ``ShardedTensor`` with its global shape and offset, ``replica_id`` 0), and
writes the chunks, metadata and common state exactly as it does for a real run. The values are
seeded random numbers (``--seed``); the names, splits and non-sharded state follow a megatron-core
GPT with a non-distributed Adam: per layer ``linear_qkv``/``linear_fc1`` split over TP on axis 0,
``linear_proj``/``linear_fc2`` on axis 1, norms replicated; layers split evenly over PP; the
vocabulary-parallel embedding and output layer; ``exp_avg``/``exp_avg_sq`` in fp32 with the
parameters' sharding; one ``rng_state`` per (pp, tp) coordinate, as Megatron-LM writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from megatron_ext.megatron import checkpoint_layout as ckpt_layout

#: (name suffix, global shape from (hidden, ffn), axis split over TP or None: replicated)
LAYER_TENSORS = (
    ("input_layernorm.weight", lambda h, f: (h,), None),
    ("self_attention.linear_qkv.weight", lambda h, f: (3 * h, h), 0),
    ("self_attention.linear_proj.weight", lambda h, f: (h, h), 1),
    ("pre_mlp_layernorm.weight", lambda h, f: (h,), None),
    ("mlp.linear_fc1.weight", lambda h, f: (f, h), 0),
    ("mlp.linear_fc2.weight", lambda h, f: (h, f), 1),
)


def parameters(layers: int, hidden: int, ffn: int, vocab: int, pp: int) -> list[tuple[str, tuple, int | None, int]]:
    """(key, global shape, TP axis or None, pipeline stage) of every parameter."""
    if layers % pp:
        raise ValueError(f"{layers} layers do not split into {pp} pipeline stages")
    per_stage = layers // pp
    params = [("embedding.word_embeddings.weight", (vocab, hidden), 0, 0)]
    for layer in range(layers):
        for suffix, shape, axis in LAYER_TENSORS:
            params.append((f"decoder.layers.{layer}.{suffix}", shape(hidden, ffn), axis, layer // per_stage))
    params.append(("decoder.final_layernorm.weight", (hidden,), None, pp - 1))
    params.append(("output_layer.weight", (vocab, hidden), 0, pp - 1))
    return params


def state_dict(tp: int, pp: int, dp: int, layers: int, hidden: int, ffn: int, vocab: int, seed: int,
               iteration: int) -> tuple[dict, int]:
    """Every shard of the layout as one sharded state dict, and its tensor bytes."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    generator = torch.Generator().manual_seed(seed)
    tensors: list[Any] = []
    nbytes = 0
    for key, shape, axis, _stage in parameters(layers, hidden, ffn, vocab, pp):
        for prefix, dtype in (("", torch.bfloat16), ("optimizer.state.exp_avg.", torch.float32),
                              ("optimizer.state.exp_avg_sq.", torch.float32)):
            whole = torch.randn(shape, generator=generator).to(dtype)
            nbytes += whole.numel() * whole.element_size()
            if axis is None:
                tensors.append(ShardedTensor.from_rank_offsets(prefix + key, whole, replica_id=0))
                continue
            if shape[axis] % tp:
                raise ValueError(f"{key}: {shape[axis]} does not split over TP={tp}")
            for tp_rank, part in enumerate(whole.chunk(tp, dim=axis)):
                tensors.append(ShardedTensor.from_rank_offsets(prefix + key, part.contiguous(), (axis, tp_rank, tp),
                                                               replica_id=0))
    rng = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            torch.manual_seed(seed + 1000 * pp_rank + tp_rank)  # a distinct state per coordinate
            states = ckpt_layout.capture_rng_state()
            rng.append(ckpt_layout.megatron_lm_rng_object(states, {"pp": pp, "tp": tp, "pp_rank": pp_rank,
                                                                   "tp_rank": tp_rank, "dp_rank": 0}))
    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                              world_size=tp * pp * dp, num_layers=layers, hidden_size=hidden,
                              ffn_hidden_size=ffn, padded_vocab_size=vocab, seed=seed)
    state = {
        "model_and_optimizer_shards": tensors,
        "optimizer": {"param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]},
        "opt_param_scheduler": {"max_lr": 1e-4, "min_lr": 1e-5, "num_steps": iteration},
        "rng_state": rng,
        "iteration": iteration,
        "args": args,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": 0,
    }
    return state, nbytes


def write(out: str, tp: int, pp: int, dp: int, *, layers: int = 10, hidden: int = 256, ffn: int = 1024,
          vocab: int = 1024, seed: int = 1234, iteration: int = 7) -> dict:
    """Write ``out/iter_NNNNNNN`` and the tracker; returns what was written."""
    from megatron.core import dist_checkpointing

    from megatron_ext.megatron.convert import single_process_group

    state, nbytes = state_dict(tp, pp, dp, layers, hidden, ffn, vocab, seed, iteration)
    ckpt = ckpt_layout.checkpoint_dir(out, iteration)
    os.makedirs(ckpt)
    with single_process_group():
        dist_checkpointing.save(state, ckpt)
    ckpt_layout.write_tracker(out, iteration)
    return {"checkpoint": ckpt, "iteration": iteration, "ranks": tp * pp * dp, "tensor_bytes": nbytes,
            "shards": len(state["model_and_optimizer_shards"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    for name, default in (("tp", 4), ("pp", 5), ("dp", 9), ("layers", 10), ("hidden", 256), ("ffn", 1024),
                          ("vocab", 1024), ("seed", 1234), ("iteration", 7)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    summary = write(a.out, a.tp, a.pp, a.dp, layers=a.layers, hidden=a.hidden, ffn=a.ffn, vocab=a.vocab,
                    seed=a.seed, iteration=a.iteration)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
