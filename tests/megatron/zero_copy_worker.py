"""torchrun worker: the snapshot reads the distributed optimizer's state in place (no copies)."""

import sys

import torch
import torch.distributed as dist

from megatron_ext.megatron import checkpointing, core_state, sharding
from megatron_ext.testing import reference_trainer as trainer


def main() -> None:
    args = trainer.build_parser().parse_args(["--bf16", "--use-distributed-optimizer", "--train-iters", "4"])
    trainer.initialize_distributed(args)
    model, config = trainer.build_model(args)
    optimizer, scheduler = trainer.build_optimizer(args, model, config)
    trainer.train_step(args, 1, model, optimizer, scheduler)  # Adam state exists after one step

    inner = optimizer.chained_optimizers[0].optimizer
    live = {p.untyped_storage().data_ptr() for g in inner.param_groups for p in g["params"]}
    live |= {t.untyped_storage().data_ptr() for s in inner.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0}

    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    checkpointing.set_args(args)
    sharded, _ = save_preprocess(core_state.sharded_state(core_state.unwrap(model), optimizer, True),
                                 validate_access_integrity=False)
    shards = list(sharding.sharded_leaves(sharded))
    plan = sharding.plan_ownership(shards, dist.get_rank(), dist.get_world_size(), lambda obj: [obj])
    tensors, _, meta = sharding.split_owned(shards, plan)
    optimizer_shards = {sid: t for sid, t in tensors.items() if sid.startswith("optimizer.")}
    # One fp32 main param and two Adam moments per parameter, each a slice of the parameter's box.
    assert len(optimizer_shards) == 3 * sum(len(g["params"]) for g in inner.param_groups), len(optimizer_shards)
    assert all("flattened_range" in meta[sid] for sid in optimizer_shards)
    copies = [sid for sid, t in optimizer_shards.items() if t.untyped_storage().data_ptr() not in live]
    assert not copies, f"{len(copies)} optimizer shards are copies, e.g. {copies[:3]}"
    print(f"zero-copy: {len(optimizer_shards)} of {len(optimizer_shards)} optimizer shards alias live state",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
