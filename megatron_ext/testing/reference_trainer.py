"""Reference trainer: a small megatron-core GPT with TP/PP/DP, deterministic data and checkpoints.

Run with ``torchrun --nproc-per-node N -m megatron_ext.testing.reference_trainer [args]``. It uses
the real megatron-core building blocks (``GPTModel``, ``DistributedDataParallel``, the distributed
optimizer, the pipeline schedules, ``OptimizerParamScheduler``) so checkpointing code exercised
here sees the same objects it sees inside Megatron-LM. On a machine without GPUs it switches on
``megatron_ext.testing.cpu_emulation`` and runs over gloo.

Checkpointing goes through exactly two functions chosen at start-up by ``select_checkpointing``:
``save_checkpoint_fn(iteration, model, optimizer, scheduler, args)`` and
``load_checkpoint_fn(model, optimizer, scheduler, args) -> iteration``. The baseline pair below
uses megatron-core ``dist_checkpointing`` with the ``torch_dist`` format in Megatron's layout
(``<save>/iter_0000005/`` plus ``<save>/latest_checkpointed_iteration.txt``).

Resuming is bit-exact: as with Megatron's sampler, the global batch is a pure function of the
seed and the number of samples consumed so far (``args.consumed_train_samples``, which the
checkpoint carries), split over the data-parallel ranks; every RNG the step consumes (torch,
python, numpy, megatron's model-parallel tracker) is saved and restored.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from functools import partial
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.engine import faults
from megatron_ext.megatron.args import add_datastates_args, validate_datastates_args
from megatron_ext.megatron import optimizer_load
from megatron_ext.megatron import checkpoint_layout
from megatron_ext.megatron.checkpoint_layout import (TRACKER_FILE, capture_rng_state, checkpoint_dir,
                                                     from_megatron_lm_rng, megatron_lm_rng_object, restore_rng_state,
                                                     write_tracker)
from megatron_ext.testing.commit_wait import await_tracker
from megatron_ext.testing.cpu_emulation import enable_cpu_emulation

# Per-rank bucket-space optimizer state, no gathers or copies (``DistributedOptimizer.
# sharded_state_dict`` needs this metadata (megatron-core 0.16.1 to 0.19.0); without it, it fails on ``flattened_range``).
OPTIMIZER_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """Megatron-style command line; defaults are a tiny model that trains quickly on 2 cores."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--vocab-size", type=int, default=256)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--bf16", action="store_true")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size (one micro-batch)")
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument("--min-lr", type=float, default=1e-3)
    g.add_argument("--lr-warmup-iters", type=int, default=1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after any save) when iteration %% exit-interval == 0, as Megatron")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-json", default=None,
                   help="append one JSON line per iteration (loss as float.hex())")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint root directory")
    g.add_argument("--load", default=None, help="checkpoint root to resume from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--megatron-async-save", action="store_true",
                   help="baseline for benchmarks: megatron-core's async torch_dist save (as --async-save)")
    g.add_argument("--torch-dist-optimizer-format", default="dp_reshardable",
                   choices=("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter"),
                   help="test aid: the distributed optimizer's format in this trainer's torch_dist saves "
                        "(megatron-core's distrib_optim_sharding_type; default dp_reshardable, Megatron-LM's)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1: finish the iteration, checkpoint it, wait until every "
                        "checkpoint is committed, exit 0 (as Megatron-LM's flag)")
    g.add_argument("--throttle-writes-mbps", type=float, default=None, metavar="MB/S",
                   help="test aid: every checkpoint write of this process takes nbytes / rate longer (a slow "
                        "file system), through the engine's fault hook")
    g.add_argument("--crash-at-iteration", type=int, default=None,
                   help="test aid: SIGKILL this process right after iteration N's save call returns")
    g.add_argument("--committed-before-crash", type=int, default=None, metavar="ITERATION",
                   help="test aid, with --crash-at-iteration: before that iteration's save, wait (bounded) until "
                        "the tracker under --save names this iteration or a later one, so the crash always "
                        "leaves a committed checkpoint behind")
    g.add_argument("--resave-on-load", action="store_true",
                   help="test aid: right after loading iteration N, save the loaded state as iteration N into "
                        "--save (another directory), e.g. to compare a resharded load with its source")
    g.add_argument("--eval-fixed-batch", default=None, metavar="JSONL",
                   help="test aid: after loading and after every save, run one fixed, layout-independent batch "
                        "forward-only without dropout and append its per-token losses to this file")
    add_datastates_args(p)
    return p


# --------------------------------------------------------------------------------------------
# Start-up
# --------------------------------------------------------------------------------------------

def initialize_distributed(args: argparse.Namespace) -> None:
    """Process groups (gloo on CPU, nccl on GPU), megatron's parallel state and its RNGs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    on_cpu = enable_cpu_emulation()  # False (and a no-op) whenever CUDA is available
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="gloo" if on_cpu else "nccl")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"micro-batch-size x DP = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    args.consumed_train_samples = 0  # a checkpoint load restores it

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    # Bit-exact resumption needs reproducible kernels; on CPU this costs nothing.
    torch.use_deterministic_algorithms(True)


def build_model(args: argparse.Namespace):
    """This pipeline stage's GPT, cast to bf16 (Float16Module) and wrapped in megatron's DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=True,
        init_method_std=0.02,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
    )
    module = Float16Module(config, gpt) if args.bf16 else gpt
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    # What Megatron-LM's setup does: the schedule syncs grads through these hooks.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model, config


def build_optimizer(args: argparse.Namespace, model, config):
    """megatron's Adam (a ChainedOptimizer over DistributedOptimizer) and its LR scheduler."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
        clip_grad=args.clip_grad,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        # Counted in samples, as Megatron-LM does (``step(increment=global_batch_size)``).
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size,
        lr_decay_style="cosine",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

def synthetic_batch(seed: int, first_sample: int, dp_rank: int, num_microbatches: int,
                    micro_batch_size: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """This data-parallel rank's token ids ``[num_microbatches, micro_batch_size, seq_length + 1]``.

    The global batch is samples ``first_sample, first_sample + 1, ...``; rank ``r`` takes the
    ``r``-th contiguous run of ``num_microbatches * micro_batch_size`` of them. Sample ``k`` is a
    pure function of ``(seed, k)`` (a private generator, never the global RNG), so the data depend
    neither on where a run started nor on its parallel layout. Each row is an arithmetic
    progression modulo the vocabulary, which a small model learns quickly (the loss visibly falls).
    """
    per_rank = num_microbatches * micro_batch_size
    rows = []
    for sample in range(first_sample + dp_rank * per_rank, first_sample + (dp_rank + 1) * per_rank):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + sample * 7_919) % (2**63 - 1))
        start = torch.randint(0, vocab_size, (1,), generator=gen)
        stride = torch.randint(1, 3, (1,), generator=gen)
        rows.append((start + stride * torch.arange(seq_length + 1)) % vocab_size)
    return torch.stack(rows).view(num_microbatches, micro_batch_size, seq_length + 1)


def microbatch_iterator(tokens: torch.Tensor) -> Iterator[dict]:
    """Yield the schedule's micro-batches: inputs, shifted labels, a full loss mask."""
    for mb in tokens:
        yield {
            "tokens": mb[:, :-1].contiguous(),
            "labels": mb[:, 1:].contiguous(),
            "loss_mask": torch.ones(mb.shape[0], mb.shape[1] - 1, dtype=torch.float32),
        }


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch (the schedule divides by the number of micro-batches)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    # A copy: the schedule divides the returned loss by the micro-batch count in place.
    return loss, {"lm loss": loss.detach().clone()}


def _token_losses_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Evaluation: the mean loss and every token's loss of one micro-batch."""
    loss, _ = _loss_func(loss_mask, output_tensor)
    return loss, {"token losses": output_tensor.float().detach().clone()}


def _forward_step(data_iterator, model, loss_func=_loss_func):
    """One micro-batch through this stage; the last stage also returns the loss function."""
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# --------------------------------------------------------------------------------------------
# Baseline checkpointing: megatron-core dist_checkpointing, torch_dist format
# --------------------------------------------------------------------------------------------

def read_tracker(root: str) -> Optional[int]:
    """The iteration named by the tracker file (0 for a release), or None when there is no checkpoint yet."""
    iteration = checkpoint_layout.read_tracker(root)
    return 0 if iteration == checkpoint_layout.RELEASE else iteration


def unwrap_model(model):
    """The module whose ``sharded_state_dict`` megatron uses: inside DDP (and Float16Module)."""
    return model.module


def rng_state_object(args: argparse.Namespace, rng: Optional[dict] = None):
    """This rank's RNG states as Megatron-LM's torch_dist checkpoints hold them (``rng_state``)."""
    from megatron.core import parallel_state

    layout = {"pp": args.pipeline_model_parallel_size, "tp": args.tensor_model_parallel_size,
              "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
              "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "dp_rank": parallel_state.get_data_parallel_rank()}
    return megatron_lm_rng_object(rng, layout)


def optimizer_metadata(args: argparse.Namespace) -> dict:
    """The content metadata of this trainer's torch_dist saves: the optimizer format it writes."""
    fmt = getattr(args, "torch_dist_optimizer_format", None)
    return {"distrib_optim_sharding_type": fmt} if fmt else dict(OPTIMIZER_SHARDING_METADATA)


def build_sharded_state_dict(model, optimizer, scheduler, args, iteration: int,
                             is_loading: bool, content_metadata: Optional[dict] = None) -> dict:
    """Megatron's checkpoint content: model, optimizer, scheduler, RNG, iteration and args.

    ``content_metadata`` says how the optimizer state is laid out (default: this trainer's
    ``--torch-dist-optimizer-format``); loading passes the checkpoint's own, as Megatron-LM does.
    """
    model_sd = unwrap_model(model).sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(content_metadata or optimizer_metadata(args))),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": rng_state_object(args, None if is_loading else capture_rng_state()),
        "iteration": iteration,
        "args": argparse.Namespace(**vars(args)),
        "checkpoint_version": 3.0,
    }


def save_checkpoint_torch_dist(iteration: int, model, optimizer, scheduler,
                               args: argparse.Namespace) -> None:
    """Synchronous torch_dist save of this iteration, then the tracker (rank 0, after a barrier)."""
    from megatron.core import dist_checkpointing

    ckpt = checkpoint_dir(args.save, iteration)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    state = build_sharded_state_dict(model, optimizer, scheduler, args, iteration,
                                     is_loading=False)
    dist_checkpointing.save(state, ckpt, content_metadata=optimizer_metadata(args))
    dist.barrier()
    if dist.get_rank() == 0:
        write_tracker(args.save, iteration)
    dist.barrier()


def load_checkpoint_torch_dist(model, optimizer, scheduler, args: argparse.Namespace) -> int:
    """Restore the tracker's checkpoint into model, optimizer, scheduler and RNGs; 0 if none."""
    from megatron.core import dist_checkpointing

    iteration = read_tracker(args.load)
    if iteration is None:
        return 0
    ckpt = checkpoint_dir(args.load, iteration)
    optimizer_load.ensure_state(optimizer)
    # The optimizer layout the checkpoint was written with (e.g. fully_reshardable after a convert).
    content_metadata = dist_checkpointing.load_content_metadata(ckpt)
    template = build_sharded_state_dict(model, optimizer, scheduler, args, iteration,
                                        is_loading=True, content_metadata=content_metadata)
    state = dist_checkpointing.load(template, ckpt)
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    if (content_metadata or {}).get("distrib_optim_sharding_type") == "fully_reshardable":
        optimizer_load.load_fully_reshardable_state_dict(optimizer, state["optimizer"])
    else:
        with optimizer_load.steps_set_aside(optimizer):  # dp_zero_gather_scatter hands over no "step"
            optimizer.load_state_dict(state["optimizer"])
        optimizer_load.restore_adam_steps(optimizer)
    scheduler.load_state_dict(state["opt_param_scheduler"])
    restore_rng_state(from_megatron_lm_rng(state["rng_state"]))
    saved_args = state["args"]
    saved_args = vars(saved_args) if isinstance(saved_args, argparse.Namespace) else saved_args
    args.consumed_train_samples = int(saved_args["consumed_train_samples"])
    return int(state["iteration"])


SaveFn = Callable[..., None]
LoadFn = Callable[..., int]


def save_checkpoint_datastates(iteration: int, model, optimizer, scheduler, args: argparse.Namespace) -> None:
    """The drop-in Megatron-LM ``save_checkpoint``, called as Megatron's training loop calls it."""
    from megatron_ext.megatron import checkpointing

    checkpointing.set_args(args)
    checkpointing.save_checkpoint(iteration, [model], optimizer, scheduler, 0)


def load_checkpoint_datastates(model, optimizer, scheduler, args: argparse.Namespace) -> int:
    from megatron_ext.megatron import checkpointing

    checkpointing.set_args(args)
    iteration, _ = checkpointing.load_checkpoint([model], optimizer, scheduler)
    return iteration


def save_checkpoint_megatron_async(iteration: int, model, optimizer, scheduler, args: argparse.Namespace) -> None:
    """megatron-core's own asynchronous torch_dist save, scheduled and finalized as Megatron-LM does.

    The call stages the tensors (the part that blocks training) and hands the write to a
    background process; the tracker is written by the finalize step once every rank is done.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    global _async_queue
    if _async_queue is None:
        _async_queue = AsyncCallsQueue()
    ckpt = checkpoint_dir(args.save, iteration)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    state = build_sharded_state_dict(model, optimizer, scheduler, args, iteration, is_loading=False)
    # "mcore": megatron-core's own async writer (the default, "nvrx", needs nvidia-resiliency-ext).
    request = dist_checkpointing.save(state, ckpt, async_sharded_save=True, async_strategy="mcore",
                                      content_metadata=optimizer_metadata(args))
    rank = dist.get_rank()
    request.add_finalize_fn(lambda: write_tracker(args.save, iteration) if rank == 0 else None)
    _async_queue.schedule_async_request(request)


_async_queue = None
_blocked_s = [0.0]  # seconds spent inside checkpoint calls on this rank (non-datastates modes)


def timed_checkpoint_call(fn: Callable, *args, **kwargs):
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        _blocked_s[0] += time.perf_counter() - start


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this rank (``bench train``'s account):

    * ``cpu_s``: its process, every thread, and its child processes: the I/O worker, read live
      from ``/proc``, and those already reaped (an async save's forked writers);
    * ``cpu_main_s``: the training thread alone (the caller);
    * ``cpu_engine_s``: the live threads the engine named (``engine/threads.py``; one that ended leaves
      the sum, as the host cache's allocation does once) and the child processes.

    Where ``/proc`` is missing, only the process and its reaped children are counted.
    """
    import resource

    from megatron_ext.engine.threads import OS_PREFIX, proc_cpu_seconds, thread_cpu_seconds

    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    children_s = reaped.ru_utime + reaped.ru_stime
    if os.path.isdir("/proc/self/task"):
        children: set[str] = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children") as f:
                    children.update(f.read().split())
            except OSError:  # it ended meanwhile
                continue
        children_s += sum(proc_cpu_seconds(f"/proc/{pid}/stat") for pid in children)
    engine_s = thread_cpu_seconds(lambda name: name.startswith(OS_PREFIX))
    return {"cpu_s": time.process_time() + children_s, "cpu_main_s": time.thread_time(),
            "cpu_engine_s": engine_s + children_s}


def checkpoint_blocked_seconds(args: argparse.Namespace) -> float:
    """Time training has waited for checkpointing so far on this rank.

    With datastates this is the engine's count (``save`` calls plus the lazy wait inside the
    optimizer step); otherwise the time spent in the save and finalize calls.
    """
    if args.use_datastates:
        from megatron_ext.megatron import checkpointing

        engine = checkpointing.current_engine()
        return engine.blocked_total_s if engine is not None else 0.0
    return _blocked_s[0]


def finalize_checkpoints(args: argparse.Namespace, blocking: bool) -> None:
    """Megatron-LM's ``maybe_finalize_async_save``: every iteration (non-blocking) and at the end."""
    if args.use_datastates:
        from megatron_ext.megatron import checkpointing

        checkpointing.finalize_checkpoints(blocking=blocking, terminate=blocking)
    elif _async_queue is not None:
        _async_queue.maybe_finalize_async_calls(blocking=blocking)
        if blocking:
            _async_queue.close()


def finish_checkpointing(args: argparse.Namespace) -> None:
    """End of training: every pending checkpoint committed before the process exits."""
    finalize_checkpoints(args, blocking=True)


def select_checkpointing(args: argparse.Namespace) -> Tuple[SaveFn, LoadFn]:
    """The one place that decides how checkpoints are written and read."""
    if args.use_datastates:
        validate_datastates_args(args)
        return save_checkpoint_datastates, load_checkpoint_datastates
    if args.megatron_async_save:
        return save_checkpoint_megatron_async, load_checkpoint_torch_dist
    return save_checkpoint_torch_dist, load_checkpoint_torch_dist


# --------------------------------------------------------------------------------------------
# Training loop
# --------------------------------------------------------------------------------------------

def train_step(args, iteration: int, model, optimizer, scheduler) -> Optional[float]:
    """One global batch: forward/backward over all micro-batches, optimizer and scheduler step.

    Returns the DP-averaged loss on the logging rank (last pipeline stage), else None.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = synthetic_batch(args.seed, args.consumed_train_samples, parallel_state.get_data_parallel_rank(),
                             args.num_microbatches, args.micro_batch_size, args.seq_length,
                             args.vocab_size)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=microbatch_iterator(tokens),
        model=[model],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    # ChainedOptimizer.step() = prepare_grads, clip, step_with_ready_grads (the inner AdamW step
    # that mutates fp32 main params and moments, then the bf16 param all-gather). A lazy
    # checkpoint must finish its snapshot before step_with_ready_grads runs.
    success, _grad_norm, _ = optimizer.step()
    if not success:
        raise RuntimeError(f"optimizer step skipped at iteration {iteration}")
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size

    if not parallel_state.is_pipeline_last_stage():
        return None
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return (loss / args.data_parallel_size).item()


def evaluate_fixed_batch(args, iteration: int, model) -> None:
    """Per-token losses of one fixed global batch (seed ``seed + 1``, samples ``0..global batch``).

    Forward only, dropout off: the outputs depend on the model's state alone, so runs of other
    parallel layouts can compare them. The logging rank appends ``{"iteration", "token_losses"}``
    (samples in order, as floats) to ``--eval-fixed-batch``.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = synthetic_batch(args.seed + 1, 0, parallel_state.get_data_parallel_rank(), args.num_microbatches,
                             args.micro_batch_size, args.seq_length, args.vocab_size)
    model.eval()
    try:
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_func=_token_losses_func),
                data_iterator=microbatch_iterator(tokens), model=[model], num_microbatches=args.num_microbatches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True)
    finally:
        model.train()
    if not parallel_state.is_pipeline_last_stage():
        return
    mine = torch.cat([out["token losses"] for out in outputs])
    group = parallel_state.get_data_parallel_group()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if _is_logging_rank():
        with open(args.eval_fixed_batch, "a") as f:
            f.write(json.dumps({"iteration": iteration, "token_losses": torch.cat(everyone).tolist()}) + "\n")


def install_exit_signal_handler() -> list[int | None]:
    """SIGTERM/SIGUSR1 only set a flag; the loop stops cleanly after the current iteration."""
    received: list[int | None] = [None]

    def handler(signum, frame):
        received[0] = signum

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, handler)
    return received


def _any_rank(flag) -> bool:
    """All ranks stop at the same iteration if any of them got the signal."""
    hit = torch.tensor([1 if flag else 0])
    dist.all_reduce(hit, op=dist.ReduceOp.MAX)
    return bool(hit.item())


def _is_logging_rank() -> bool:
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def train(args: argparse.Namespace) -> List[float]:
    """Build everything, resume if asked, train to ``--train-iters``; returns logged losses.

    Iterations are numbered from 1 like Megatron; a checkpoint taken after iteration ``k`` is
    ``iter_000000k`` and resuming from it runs iteration ``k + 1`` next.
    """
    if args.resave_on_load and not (args.load and args.save
                                    and os.path.abspath(args.load) != os.path.abspath(args.save)):
        raise ValueError("--resave-on-load needs --load and a different --save directory")
    initialize_distributed(args)
    if args.throttle_writes_mbps:
        faults.arm(faults.throttle(args.throttle_writes_mbps * 1e6))
    save_checkpoint_fn, load_checkpoint_fn = select_checkpointing(args)
    model, config = build_model(args)
    optimizer, scheduler = build_optimizer(args, model, config)

    iteration = 0
    load_s = None  # the slowest rank's load time, logged with the first iteration after it
    load_started_at = time.time()
    if args.load:
        started = time.perf_counter()
        iteration = load_checkpoint_fn(model, optimizer, scheduler, args)
        load_s = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(load_s, op=dist.ReduceOp.MAX)
        load_s = load_s.item()
        if args.resave_on_load and iteration > 0:
            save_checkpoint_fn(iteration, model, optimizer, scheduler, args)
        if args.eval_fixed_batch and iteration > 0:
            evaluate_fixed_batch(args, iteration, model)

    log = open(args.log_json, "a") if args.log_json and _is_logging_rank() else None
    losses = []
    checkpointing_on = bool(args.save and args.save_interval)
    stop_signal = install_exit_signal_handler() if args.exit_signal_handler else None
    try:
        while iteration < args.train_iters:
            start = time.perf_counter()
            blocked_before = checkpoint_blocked_seconds(args)
            loss = train_step(args, iteration + 1, model, optimizer, scheduler)
            iteration += 1
            if args.committed_before_crash is not None and args.crash_at_iteration == iteration:
                await_tracker(os.path.join(args.save, TRACKER_FILE), args.committed_before_crash, int)
            save_call_cpu_s = None  # the training thread's CPU seconds in this iteration's save call
            if checkpointing_on and iteration % args.save_interval == 0:
                cpu_before = time.thread_time()
                timed_checkpoint_call(save_checkpoint_fn, iteration, model, optimizer, scheduler, args)
                save_call_cpu_s = time.thread_time() - cpu_before
                if args.eval_fixed_batch:
                    evaluate_fixed_batch(args, iteration, model)
            timed_checkpoint_call(finalize_checkpoints, args, blocking=False)
            elapsed = time.perf_counter() - start
            blocked = torch.tensor([checkpoint_blocked_seconds(args) - blocked_before])
            if checkpointing_on:  # the slowest rank is the one training waits for
                dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
            if loss is not None and _is_logging_rank():
                losses.append(loss)
                print(f"iteration {iteration:6d} | loss {loss:.6f} | "
                      f"lr {scheduler.get_lr(optimizer.param_groups[0]):.3e} | "
                      f"time {elapsed * 1000:.1f} ms | checkpoint blocked {blocked.item() * 1000:.1f} ms",
                      flush=True)
                if log is not None:
                    log.write(json.dumps({"iteration": iteration, "loss": float(loss).hex(),
                                          "consumed_samples": args.consumed_train_samples,
                                          "lr": scheduler.get_lr(optimizer.param_groups[0]).hex(),
                                          "loss_float": loss, "iter_time_s": elapsed,
                                          "ckpt_blocked_s": blocked.item(), "save_call_cpu_s": save_call_cpu_s,
                                          "wall_time": time.time(),
                                          **process_cpu_seconds(),
                                          **({"load_s": load_s, "load_started_at": load_started_at}
                                             if load_s is not None else {})}) + "\n")
                    load_s = None
                    log.flush()
            if args.crash_at_iteration == iteration:
                # Every rank is past this iteration's record first: the rank that dies first would
                # otherwise have torchrun stop the logging rank before it wrote the record.
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            if stop_signal is not None and _any_rank(stop_signal[0]):
                if args.save and not (checkpointing_on and iteration % args.save_interval == 0):
                    save_checkpoint_fn(iteration, model, optimizer, scheduler, args)
                if _is_logging_rank():
                    print(f"exit signal received: checkpoint of iteration {iteration} taken, committing and "
                          "exiting", flush=True)
                break
            if args.exit_interval and iteration % args.exit_interval == 0:
                break
    finally:
        if log is not None:
            log.close()
    finish_checkpointing(args)
    dist.barrier()
    return losses


def main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.committed_before_crash is not None and (args.crash_at_iteration is None or not args.save):
        parser.error("--committed-before-crash needs --crash-at-iteration and --save")
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
