"""DeepSpeed test harness: a tiny deterministic model trained with real DeepSpeed on CPU ranks.

Why it exists: the ``datastates`` module is loaded by DeepSpeed itself (``"datastates_ckpt"`` in
the config), so the only honest test is a real ``DeepSpeedEngine`` calling it. This script saves
a checkpoint after every step, can kill itself with SIGKILL right after a save (a real crash),
resumes with ``load_checkpoint`` and logs every loss as ``float.hex()`` so an uninterrupted run
and a crashed-and-resumed run can be compared bit for bit.

Run (2 CPU ranks, gloo)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \\
        -m megatron_ext.testing.deepspeed_harness --zero-stage 1 --steps 6 --save-dir /tmp/ck \\
        [--load] [--engine torch|datastates] [--pipeline] [--log-json PATH] [--kill-at-step K]

Determinism: fp32 everywhere (no autocast), DeepSpeed's ``torch_adam`` with ``adam_w_mode: false``
(plain ``torch.optim.Adam``; DeepSpeed's "Adam" otherwise means AdamW, and without ``torch_adam``
it wants its own compiled Adam ops), one OpenMP thread, gloo collectives over a fixed rank count, and
batches that are a pure function of ``(seed, step, data-parallel rank)``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time

# DeepSpeed picks its accelerator at import time; without a GPU it would guess, so say it.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

IN_DIM, HIDDEN, OUT_DIM = 16, 32, 4
MICRO_BATCH = 4


def _layers(hidden: int = HIDDEN) -> list[nn.Module]:
    """The model as a flat layer list, so the same weights serve the plain and the pipeline engine."""
    return [nn.Linear(IN_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, OUT_DIM)]


class TinyModel(nn.Module):
    """MLP returning the MSE loss, the way ``engine(x, y)`` expects for a non-pipeline engine."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.net = nn.Sequential(*_layers(hidden))

    def forward(self, x, y):
        dtype = self.net[0].weight.dtype  # DeepSpeed casts the module for bf16/fp16, not the batch
        out = self.net(x.to(dtype))
        return nn.functional.mse_loss(out.float(), y)


def batch(seed: int, step: int, dp_rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch for (step, dp rank, micro): no hidden RNG, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + dp_rank) * 101 + micro)
    x = torch.randn(MICRO_BATCH, IN_DIM, generator=g)
    y = torch.randn(MICRO_BATCH, OUT_DIM, generator=g)
    return x, y


def ds_config(args) -> dict:
    """DeepSpeed config: fp32, Adam via torch, ZeRO ``--zero-stage``; datastates section if asked."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": args.micro_batches if args.pipeline else 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True,
                                                         "adam_w_mode": False}},
        # Small buckets: the 5e8-element defaults cost GBs of host memory per rank for nothing.
        "zero_optimization": {"stage": args.zero_stage, "reduce_bucket_size": 1_000_000,
                              "allgather_bucket_size": 1_000_000},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif args.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if args.scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4}}
    if args.engine == "datastates":
        cfg["datastates_ckpt"] = {"host_cache_size": 1}
    return cfg


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3],
                   help="ZeRO stage (1 and 2 are the tested ones)")
    p.add_argument("--steps", type=int, required=True, help="train until this global step")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--load", action="store_true", help="resume from --save-dir (its 'latest' tag)")
    p.add_argument("--engine", choices=["torch", "datastates"], default="torch")
    p.add_argument("--pipeline", action="store_true", help="2-stage PipelineModule, train_batch()")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step with --pipeline")
    p.add_argument("--log-json", default=None, help="rank 0 appends one JSON line per step here")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="every rank SIGKILLs itself right after this step's save_checkpoint returns")
    p.add_argument("--committed-before-kill", type=int, default=None, metavar="STEP",
                   help="with --kill-at-step: before that step's save, wait (bounded) until 'latest' names this "
                        "step or a later one, so the crash always leaves a committed checkpoint behind")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="training precision (DeepSpeed's bf16/fp16 sections; fp32 is the bit-exact default)")
    p.add_argument("--scheduler", action="store_true", help="DeepSpeed's WarmupLR scheduler (saved with the state)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden width (benchmarks use a larger model)")
    p.add_argument("--no-save", action="store_true", help="train without checkpoints (benchmark baseline)")
    return p.parse_args(argv)


def build_engine(args):
    """Initialize gloo and the DeepSpeed engine; the model init depends only on ``--seed``."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == "cpu", "run with DS_ACCELERATOR=cpu"
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    if args.pipeline:
        from deepspeed.pipe import PipelineModule
        model = PipelineModule(layers=_layers(args.hidden), num_stages=2, partition_method="uniform",
                               loss_fn=nn.functional.mse_loss)
    else:
        model = TinyModel(args.hidden)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args))
    return engine


def _hexes(values: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in values.tolist()]


def _datastates_wait_total(engine) -> float:
    """Seconds the datastates engine has blocked in wait_snapshot so far (0 for other engines)."""
    adapter = getattr(getattr(engine, "checkpoint_engine", None), "ckpt_engine", None)
    return getattr(getattr(adapter, "engine", None), "wait_total_s", 0.0)


def _await_committed(save_dir: str, step: int, rank: int) -> None:
    """Rank 0 waits until ``latest`` names ``step`` or later (``commit_wait``); every rank then goes on together."""
    import torch.distributed as dist

    from megatron_ext.testing.commit_wait import await_tracker

    if rank == 0:
        await_tracker(os.path.join(save_dir, "latest"), step, lambda tag: int(tag.removeprefix("global_step")))
    dist.barrier()


def main(argv=None) -> int:
    args = parse_args(argv)
    # Not torch.use_deterministic_algorithms(True): it NaN-fills every torch.empty, and ZeRO's
    # bucket buffers made backward ~4 s/step. One-thread CPU kernels are deterministic already.
    torch.set_num_threads(1)
    engine = build_engine(args)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = engine.mpu.get_data_parallel_rank() if args.pipeline else rank

    start = 0
    if args.load:
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise SystemExit(f"rank {rank}: no checkpoint to load in {args.save_dir}")
        start = engine.global_steps
        assert client.get("harness_step") == start, (client.get("harness_step"), start)

    log = open(args.log_json, "a") if (args.log_json and rank == 0) else None
    last_wait = _datastates_wait_total(engine)
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        if args.pipeline:
            micro = iter([batch(args.seed, step, dp_rank, m) for m in range(args.micro_batches)])
            loss = engine.train_batch(data_iter=micro).detach().float()
        else:
            x, y = batch(args.seed, step, dp_rank)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss = loss.detach().float()
        t1 = time.perf_counter()
        if args.kill_at_step == step and args.committed_before_kill is not None:
            _await_committed(args.save_dir, args.committed_before_kill, rank)
        if not args.no_save:
            engine.save_checkpoint(args.save_dir, client_state={"harness_step": step})
        t2 = time.perf_counter()
        # Time training waited for checkpointing: the save call, plus (datastates) the lazy wait
        # the optimizer-step hook did inside this step.
        waited = _datastates_wait_total(engine)
        blocked = (t2 - t1) + waited - last_wait
        last_wait = waited

        # Every rank's loss and local parameter sum (float64) -> rank 0, for bit-exact comparisons.
        local = torch.tensor([loss.item(), sum(p.detach().double().sum().item()
                                               for p in engine.module.parameters()), blocked],
                             dtype=torch.float64)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        if log is not None:
            rec = {"step": step, "loss": float(loss.item()).hex(),
                   "rank_losses": _hexes(torch.stack([g[0] for g in gathered])),
                   "rank_param_sums": _hexes(torch.stack([g[1] for g in gathered])),
                   "step_s": t1 - t0, "save_s": t2 - t1, "iter_s": t2 - t0,
                   "ckpt_blocked_s": max(g[2].item() for g in gathered), "engine": args.engine,
                   "zero_stage": args.zero_stage, "pipeline": args.pipeline, "resumed": args.load}
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if args.kill_at_step == step:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    if log is not None:
        log.close()
    # Orderly teardown: a rank that exits while its peer still holds the gloo group can make the
    # peer abort (SIGABRT) in the process-group destructor.
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _exit_now(rc: int) -> None:
    """Exit once everything is written, without the interpreter's final teardown.

    About one run in ten on a loaded machine aborted there ("terminate called without an active
    exception", no Python frame left: a native thread's object destroyed at finalization), after
    training, saving and the process group's teardown had all finished. atexit handlers (the
    datastates engine's last commit among them) still run first.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    _exit_now(main())
