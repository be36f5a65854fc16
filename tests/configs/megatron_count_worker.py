"""Megatron-LM's own reading of a template's command line, and the model it builds from it.

    python megatron_count_worker.py CHECKOUT REQUESTS.json

REQUESTS.json: ``[{"name": ..., "world_size": N, "argv": [pretrain_gpt.py arguments]}, ...]``, the
arguments as ``scripts/launch.sh --dry-run`` prints them. For each one, in this process: the
checkout's ``parse_args`` (an unknown flag exits here) and ``validate_args`` with the template's
world size, the tokenizer (it pads the vocabulary), ``core_transformer_config_from_args`` at the
template's tensor-parallel size (its checks of heads and key/value groups against TP), then
``gpt_builders.gpt_builder`` (what ``pretrain_gpt.py`` calls) builds the whole model on the meta
device (no memory) as one rank (TP = PP = 1, the local transformer implementation: the same
parameters as Transformer Engine's layers, which fuse the norms into the linear layers). Prints
one JSON line per request: the parameter count and the architecture as Megatron-LM holds it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings


def main() -> None:
    checkout, requests_file = sys.argv[1], sys.argv[2]
    sys.path.insert(0, checkout)
    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import arguments, global_vars
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    arguments.get_device_arch_version = lambda: 8  # validate_args asks when TP > 1 (an A100: 8)
    requests = json.loads(open(requests_file).read())

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    from gpt_builders import gpt_builder  # the checkout's, next to pretrain_gpt.py

    for req in requests:
        os.environ["WORLD_SIZE"] = str(req["world_size"])
        sys.argv = ["pretrain_gpt.py", *req["argv"]]
        args = arguments.parse_args()
        arguments.validate_args(args)
        build_tokenizer(args)  # sets args.padded_vocab_size
        args.apply_rope_fusion = False  # a Transformer Engine kernel; no TE on this machine
        arguments.core_transformer_config_from_args(args)  # at the template's TP: raises on a bad split

        # The whole model as one rank, on the meta device.
        args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
        args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
        args.world_size = args.data_parallel_size = 1
        args.transformer_impl = "local"
        args.use_cpu_initialization = True
        args.no_persist_layer_norm = True
        args.gradient_accumulation_fusion = args.masked_softmax_fusion = False
        args.bias_gelu_fusion = args.bias_swiglu_fusion = args.bias_dropout_fusion = False
        global_vars.set_args(args)
        with torch.device("meta"):
            model = gpt_builder(args, pre_process=True, post_process=True)
        names = [name for name, _ in model.named_parameters()]
        print(json.dumps({
            "name": req["name"],
            "parameters": sum(p.numel() for p in model.parameters()),
            "padded_vocab_size": args.padded_vocab_size,
            "num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "num_query_groups": model.config.num_query_groups,
            "ffn_hidden_size": args.ffn_hidden_size, "kv_channels": args.kv_channels,
            "gated_linear_unit": model.config.gated_linear_unit,
            "activation": model.config.activation_func.__name__,
            "normalization": args.normalization, "norm_epsilon": args.layernorm_epsilon,
            "position_embedding_type": args.position_embedding_type, "rotary_base": args.rotary_base,
            "untied": args.untie_embeddings_and_output_weights, "add_bias_linear": args.add_bias_linear,
            "hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout,
            "seq_length": args.seq_length, "max_position_embeddings": args.max_position_embeddings,
            "has_position_table": any("position_embeddings" in n for n in names),
            "has_output_layer": any(n.startswith("output_layer.") for n in names),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
