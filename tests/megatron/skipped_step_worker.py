"""A real fp16 megatron-core optimizer skips a step (inf grads): is the lazy snapshot waited for after it?

Run by test_skipped_step.py as ``python skipped_step_worker.py {qk_clip|plain} SAVE_DIR`` (one
process, gloo). Storage is throttled and the host cache holds a fraction of the state, so the
snapshot is still copying when ``optimizer.step()`` returns unless something waited for it.
Prints ``pending-after-step: True|False`` and ``skipped: True|False``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointError, faults
from megatron_ext.megatron import checkpointing
from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
from megatron_ext.procs import free_port


def build():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, fp16=True,
                               params_dtype=torch.float16, pipeline_dtype=torch.float16, use_cpu_initialization=True)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=512,
                   max_sequence_length=16, position_embedding_type="learned_absolute")
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                          use_distributed_optimizer=True),
                                    Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True, params_dtype=torch.float16,
                                                       use_distributed_optimizer=True, initial_loss_scale=2.0 ** 32),
                                       [model])
    return model, optimizer


def main() -> None:
    mode, save_dir = sys.argv[1], sys.argv[2]
    enable_cpu_emulation()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model, optimizer = build()
    args = argparse.Namespace(save=save_dir, use_datastates=True, datastates_host_cache_size=0.0005,
                              datastates_chunk_size_mb=0.1, qk_clip=(mode == "qk_clip"), no_save_optim=False,
                              no_save_rng=False, fp16=True, bf16=False)
    checkpointing.set_args(args)
    faults.arm(faults.throttle(2e6))  # 2 MB/s: the state (~8 MB) takes seconds to reach storage
    checkpointing.save_checkpoint(1, [model], optimizer, None, 0)
    for param in model.parameters():
        param.main_grad.fill_(float("inf"))  # overflow: the optimizer skips this step
    skipped = not optimizer.step()[0]
    engine = checkpointing.current_engine()
    try:
        engine.wait_snapshot(timeout=0)
        pending = False
    except CheckpointError:
        pending = True
    print(f"skipped: {skipped}", flush=True)
    print(f"pending-after-step: {pending}", flush=True)
    faults.disarm_all()
    checkpointing.shutdown()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
