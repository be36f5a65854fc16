"""Run by test_parallel_groups.py under torchrun (2 ranks, TP 1 / DP 2): which process groups the save path uses.

Megatron-LM (megatron-core 0.19) hands ``save_checkpoint`` / ``load_checkpoint`` the model's own
process groups; ``core_state.ParallelGroups`` carries them to the layout a checkpoint records,
the ownership plan's all-gather and the metadata the model's ``sharded_state_dict`` gets. Each
case below builds the save path's pieces for one ``dp_cp`` group on a real GPTModel; rank
``RANK`` writes what it saw to ``OUT.RANK.json``.

The default group is the CPU runs' NCCL (``emulated_nccl``); parallel_state's gloo twin of the
data-parallel group is the only gloo group with both ranks, so the group each all-gather ran on is
recorded (a wrapper that passes the call on to torch) and told apart by identity and backend.
"""

import json
import os
import sys

import torch.distributed as dist

from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
from megatron_ext.testing.emulated_nccl import enable_emulated_nccl


def tiny_gpt():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16, position_embedding_type="learned_absolute")


def main(out: str) -> None:
    enable_cpu_emulation()
    enable_emulated_nccl()
    dist.init_process_group("nccl")
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    from megatron_ext.megatron import core_state, sharding
    from megatron_ext.megatron.checkpointing import MegatronCheckpointer

    ps.initialize_model_parallel(1, 1)
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # every rank makes every group
    same_ranks = dist.new_group([0, 1])  # parallel_state's DP ranks, another group object
    gloo_twin = ps.get_data_parallel_group_gloo(with_context_parallel=True)
    model = tiny_gpt()

    used = []
    inner = dist.all_gather_object

    def all_gather_object(object_list, obj, group=None):
        used.append(group)
        return inner(object_list, obj, group=group)

    dist.all_gather_object = all_gather_object
    result = {"rank": rank}
    for name, group in {"default": None, "alone": alone, "same_ranks": same_ranks}.items():
        groups = core_state.ParallelGroups(dp_cp=group)
        used.clear()
        gathered = core_state.dp_gather(groups)({"rank": rank})
        gather_group = used[-1]
        metadata = core_state.model_metadata(groups)
        shards = list(sharding.sharded_leaves(save_preprocess(
            core_state.sharded_state([model], None, False, groups=groups), validate_access_integrity=False)[0]))
        plan = MegatronCheckpointer().ownership(shards, groups)
        result[name] = {
            "layout": core_state.parallel_layout(groups),
            "gathered": gathered,
            "gather_on_gloo_twin": gather_group is gloo_twin,
            "gather_backend": dist.get_backend(gather_group),
            "gather_on_given_group": group is not None and gather_group is group,
            "metadata_group_is_given": metadata["dp_cp_group"] is (
                group if group is not None else ps.get_data_parallel_group(with_context_parallel=True)),
            "replica_dp_entries": sorted({sharding.replica_tuple(s.replica_id)[-1] for s in shards}),
            "candidates": sorted(sid for sid, _ in sharding.candidate_signature(shards)),
            "owned": sorted(plan.owned),
            "bytes_by_dp_rank": plan.bytes_by_dp_rank,
        }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
