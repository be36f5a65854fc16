"""torchrun worker (CPU ranks, DP = world size): ``--use-precision-aware-optimizer`` saved and loaded by the adapter.

megatron-core 0.19.0's real ``DistributedOptimizer`` in its precision-aware mode, around the CPU
stand-in for Transformer Engine's FusedAdam (``megatron_ext.testing.te_fused_adam``), with the
reference trainer's GPT (bf16). ``python precision_aware_worker.py DIR VARIANT...``; a VARIANT is

* ``remainders``: fp32 main params kept as int16 remainders of the bf16 params, bf16 moments;
* ``fp16``: fp16 main params and moments, each divided by a per-slice scale.

Checks, printing one ``ok: ...`` line each: the save reads the stored tensors in place (no
``get_unscaled_state`` copy, every optimizer shard aliases the optimizer's memory), and
``megatron-ext convert`` refuses the stored form (torch_dist holds unscaled state); a fresh
optimizer loads them bit for bit (tensors and scales) and two more steps give the losses of the
uninterrupted run bit for bit; a plain optimizer and one of another stored form are refused
naming both forms; a checkpoint saved without the stored-form record (as before it existed)
loads into a plain optimizer and is refused by a precision-aware one.
"""

import os
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointError
from megatron_ext.megatron import checkpointing, core_state, optimizer_forms, optimizer_state, sharding
from megatron_ext.testing import reference_trainer as trainer
from megatron_ext.testing.te_fused_adam import precision_aware_config, use_with_megatron_core

VARIANTS = {
    "remainders": dict(main_params_dtype=torch.float32, exp_avg_dtype=torch.bfloat16,
                       exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True),
    "fp16": dict(main_params_dtype=torch.float16, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16,
                 store_param_remainders=False),
}


def say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def build(args, form: dict | None):
    """Model, optimizer and scheduler; ``form`` the precision-aware settings, None for megatron-core's plain Adam."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(args.seed)
    model, config = trainer.build_model(args)
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                                 clip_grad=args.clip_grad)
    if form is not None:  # inside use_with_megatron_core(): megatron-core as it is with TE installed
        precision_aware_config(opt_config, **form)
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
                                        lr_warmup_steps=args.global_batch_size,
                                        lr_decay_steps=args.train_iters * args.global_batch_size,
                                        lr_decay_style="cosine", start_wd=args.weight_decay,
                                        end_wd=args.weight_decay,
                                        wd_incr_steps=args.train_iters * args.global_batch_size,
                                        wd_incr_style="constant")
    return model, optimizer, scheduler


def stored(optimizer) -> dict:
    """Every stored tensor and scale of the optimizer, by (parameter index, name): cloned."""
    out = {}
    for opt in optimizer.chained_optimizers:
        for index, (model_param, _) in enumerate(optimizer_forms.param_slices(opt)):
            slices, scales = optimizer_state.stored_tensors(opt, model_param)
            for name, tensor in {**slices, **{n + "_scale": s for n, s in scales.items()}}.items():
                out[(index, name)] = tensor.detach().clone()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def step(args, iteration, model, optimizer, scheduler) -> float | None:
    return trainer.train_step(args, iteration, model, optimizer, scheduler)


def load(args, model, optimizer, scheduler) -> None:
    checkpointing.set_args(args)
    checkpointing.load_checkpoint([model], optimizer, scheduler)


def refused(args, form: dict | None, *needles: str) -> str:
    model, optimizer, scheduler = build(args, form)
    try:
        load(args, model, optimizer, scheduler)
    except CheckpointError as exc:
        missing = [n for n in needles if n not in str(exc)]
        assert not missing, f"{missing} not in: {exc}"
        say(f"refused: {exc}")
        return str(exc)
    raise AssertionError(f"a load with {form} was not refused")


def check_variant(args, variant: str) -> None:
    form = VARIANTS[variant]
    with use_with_megatron_core():  # megatron-core as it is with TE installed
        model, optimizer, scheduler = build(args, form)
        inner = optimizer.chained_optimizers[0].optimizer
        assert type(inner).__name__ == "FusedAdam"
        assert optimizer.chained_optimizers[0].config.use_precision_aware_optimizer
        for it in (1, 2):
            step(args, it, model, optimizer, scheduler)

        # --- the save reads the stored tensors in place
        checkpointing.set_args(args)
        copies = inner.unscaled_copies
        checkpointing.save_checkpoint(2, [model], optimizer, scheduler, 0)
        checkpointing.finalize_checkpoints(blocking=True)
        assert inner.unscaled_copies == copies, f"the save made {inner.unscaled_copies - copies} fp32 copies"
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

        sharded, _ = save_preprocess(core_state.sharded_state(core_state.unwrap([model]), optimizer, True),
                                     validate_access_integrity=False)
        live = {t.untyped_storage().data_ptr() for s in inner.state.values() for t in s.values()}
        live |= {t.untyped_storage().data_ptr() for s in inner._scales.values() for t in s.values()}
        leaves = [leaf for leaf in sharding.sharded_leaves(sharded) if leaf.key.startswith("optimizer.")]
        names = sorted({leaf.key.split(".")[2] for leaf in leaves})
        aliased = [leaf for leaf in leaves if leaf.data.untyped_storage().data_ptr() in live]
        assert len(aliased) == len(leaves) and leaves, (len(aliased), len(leaves))
        assert inner.unscaled_copies == copies
        say(f"ok: zero-copy save: {len(leaves)} optimizer shards alias the optimizer's stored tensors "
            f"({', '.join(names)})")
        if dist.get_rank() == 0:  # megatron-core's torch_dist formats hold unscaled state: convert refuses
            from megatron_ext.megatron import convert

            try:
                convert.to_torch_dist(args.save, 2, args.save + "_torch_dist")
                raise AssertionError("convert took a precision-aware stored form")
            except CheckpointError as exc:
                assert "--use-precision-aware-optimizer" in str(exc) and not os.path.exists(args.save + "_torch_dist")
        at_save = stored(optimizer)
        model_at_save = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        losses = [step(args, it, model, optimizer, scheduler) for it in (3, 4)]

        # --- a fresh optimizer loads the stored form bit for bit, then trains on as the uninterrupted run
        checkpointing.shutdown()
        args.consumed_train_samples = 0
        model2, optimizer2, scheduler2 = build(args, form)
        load(args, model2, optimizer2, scheduler2)
        assert same(stored(optimizer2), at_save), "the loaded stored tensors differ from the saved ones"
        loaded_model = {k: v for k, v in model2.state_dict().items() if isinstance(v, torch.Tensor)}
        assert all(torch.equal(loaded_model[k], v) for k, v in model_at_save.items())
        say(f"ok: exact load: {len(at_save)} stored tensors and scales equal the saved ones")
        resumed = [step(args, it, model2, optimizer2, scheduler2) for it in (3, 4)]
        if dist.get_rank() == 0:
            assert [float(x).hex() for x in resumed] == [float(x).hex() for x in losses], (resumed, losses)
        assert same(stored(optimizer2), stored(optimizer))
        say(f"ok: resumed losses equal the uninterrupted run's bit for bit: {losses}")

        # --- another stored form is refused, naming both and the flags
        checkpointing.shutdown()
        other = dict(form, exp_avg_dtype=torch.float32)
        refused(args, other, f"exp_avg {'bf16' if variant == 'remainders' else 'fp16'}", "now main params",
                "--exp-avg-dtype")

    checkpointing.shutdown()
    refused(args, None, "saved main params", "now main params fp32, exp_avg fp32", "--use-precision-aware-optimizer",
            "--no-load-optim")
    say("ok: a plain optimizer and another stored form are refused")


def main() -> None:
    root, variants = sys.argv[1], sys.argv[2:]
    args = trainer.build_parser().parse_args(["--bf16", "--use-distributed-optimizer", "--train-iters", "8",
                                              "--use-datastates", "--datastates-host-cache-size", "0.05"])
    trainer.initialize_distributed(args)
    for variant in variants:
        args.save = args.load = os.path.join(root, variant)
        args.consumed_train_samples = 0
        check_variant(args, variant)
    form = VARIANTS[variants[-1]]

    # --- a checkpoint without the record (as saved before it existed): the plain form
    checkpointing.shutdown()
    legacy = os.path.join(root, "legacy")
    args.save = args.load = legacy
    model3, optimizer3, scheduler3 = build(args, None)
    for it in (1, 2):
        trainer.train_step(args, it, model3, optimizer3, scheduler3)
    real_model_space = optimizer_state._model_space

    def without_record(opt, by_param, *kept):
        state = real_model_space(opt, by_param, *kept)
        state.pop(optimizer_forms.STORED_FORM)
        return state

    optimizer_state._model_space = without_record
    checkpointing.set_args(args)
    checkpointing.save_checkpoint(2, [model3], optimizer3, scheduler3, 0)
    checkpointing.finalize_checkpoints(blocking=True)
    optimizer_state._model_space = real_model_space
    plain_at_save = stored(optimizer3)
    checkpointing.shutdown()
    model4, optimizer4, scheduler4 = build(args, None)
    load(args, model4, optimizer4, scheduler4)
    assert same(stored(optimizer4), plain_at_save)
    checkpointing.shutdown()
    with use_with_megatron_core():
        refused(args, form, "saved before megatron_ext recorded the form", "now main params")
    say("ok: a checkpoint without the record loads as the plain form and is refused by the precision-aware one")
    checkpointing.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
