"""torchrun worker: the snapshot reads the distributed optimizer's state in place (no copies)."""

import sys

import torch
import torch.distributed as dist

from megatron_ext.megatron import checkpointing, optimizer_state, sharding, trainer


def main() -> None:
    args = trainer.build_parser().parse_args(["--bf16", "--use-distributed-optimizer", "--train-iters", "4"])
    trainer.initialize_distributed(args)
    model, config = trainer.build_model(args)
    optimizer, scheduler = trainer.build_optimizer(args, model, config)
    trainer.train_step(args, 1, model, optimizer, scheduler)  # Adam state exists after one step

    views = optimizer_state.owned_state_views(optimizer)
    assert views, "no optimizer state exposed"
    storages = {v.untyped_storage().data_ptr() for v in views}
    inner = optimizer.chained_optimizers[0].optimizer
    live = {p.untyped_storage().data_ptr() for g in inner.param_groups for p in g["params"]}
    live |= {t.untyped_storage().data_ptr() for s in inner.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)}
    assert storages <= live, f"{len(storages - live)} of {len(storages)} views are copies"

    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    checkpointing.set_args(args)
    sharded, _ = save_preprocess(checkpointing._sharded_state(checkpointing._unwrap(model), optimizer, False, True),
                                 validate_access_integrity=False)
    shards = list(sharding.sharded_leaves(sharded))
    plan = sharding.plan_ownership(shards, dist.get_rank(), dist.get_world_size(), lambda obj: [obj])
    tensors, _, _ = sharding.split_owned(shards, plan)
    optimizer_shards = [t for sid, t in tensors.items() if sid.startswith("optimizer.") and t.numel()]
    in_place = [t for t in optimizer_shards if t.untyped_storage().data_ptr() in live]
    # Everything but the bucket padding (fresh zeros) is read straight from the optimizer.
    assert len(in_place) >= len(optimizer_shards) - 4, (len(in_place), len(optimizer_shards))
    print(f"zero-copy: {len(in_place)} of {len(optimizer_shards)} optimizer shards alias live state", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
