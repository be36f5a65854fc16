"""``megatron-ext bench train``: the reference trainer three ways, same model, one run.

1. no checkpointing (the baseline iteration time);
2. ``--use-datastates --save-interval 1``;
3. megatron-core's ``dist_checkpointing.save(..., async_sharded_save=True)`` every iteration
   (torch_dist strategy, scheduled and finalized with ``AsyncCallsQueue`` as Megatron-LM's
   ``--async-save`` does).

Iteration time is the median over the iterations after the warm-up, and includes the checkpoint
calls. Time blocked is what the slowest rank spent in checkpointing per iteration: for datastates
the ``save`` call plus the lazy wait inside the optimizer step, for megatron-core the save call
(which stages the tensors) plus the per-iteration finalize.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from megatron_ext.arg_types import POSITIVE_INT
from megatron_ext.bench.common import run_reference_trainer, working_dir
from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE, checkpoint_dir

NAME = "train"
HELP = "reference trainer: no checkpoints vs datastates vs megatron-core async save"

MODEL = ["--bf16", "--use-distributed-optimizer", "--num-layers", "4", "--hidden-size", "512",
         "--num-attention-heads", "8", "--seq-length", "128", "--vocab-size", "8192",
         "--micro-batch-size", "4", "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]


def _progress(msg: str) -> None:
    print(f"[bench train] {msg}", file=sys.stderr, flush=True)


MODES = ("baseline", "datastates", "megatron_async")


def save_dir(base: str, mode: str, nproc: int, save_interval: int) -> str:
    """Where ``run_mode`` saves the checkpoints (and the engine its telemetry) of one run."""
    return os.path.join(base, f"{mode}-dp{nproc}-every{save_interval}")


def run_mode(mode: str, base: str, iters: int = 12, nproc: int = 2, save_interval: int = 1, warmup: int = 3,
             host_cache_gb: float = 0.5, model: list[str] = MODEL) -> dict:
    """One trainer run in ``mode`` (one of ``MODES``) in ``save_dir(...)``: per-iteration and end-to-end figures.

    ``model`` is the trainer's model arguments (default ``MODEL``). End-to-end is from the start of
    iteration 1 until the last checkpoint is committed (the tracker is written) or, without
    checkpoints, until the last iteration ends; process start-up is excluded.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    save = save_dir(base, mode, nproc, save_interval)
    extra = {"baseline": [],
             "datastates": ["--save", save, "--save-interval", str(save_interval), "--use-datastates",
                            "--datastates-host-cache-size", str(host_cache_gb)],
             "megatron_async": ["--save", save, "--save-interval", str(save_interval), "--megatron-async-save"]}[mode]
    os.makedirs(base, exist_ok=True)
    log_json = f"{save}.jsonl"
    if os.path.exists(log_json):
        os.unlink(log_json)
    records = run_reference_trainer(nproc, [*model, "--train-iters", str(iters), *extra], log_json)
    start = records[0]["wall_time"] - records[0]["iter_time_s"]
    end = records[-1]["wall_time"]
    tracker = os.path.join(save, TRACKER_FILE)
    if mode != "baseline":
        end = max(end, os.stat(tracker).st_mtime)
    measured = records[warmup:]
    result = {
        "mode": mode, "nproc": nproc, "save_interval": save_interval, "iterations": iters,
        "iterations_measured": len(measured),
        "iter_s": statistics.median(r["iter_time_s"] for r in measured),
        "iter_s_mean": statistics.mean(r["iter_time_s"] for r in measured),
        "blocked_s": statistics.mean(r["ckpt_blocked_s"] for r in measured),
        "end_to_end_s": end - start,
    }
    if mode == "datastates":
        with open(os.path.join(checkpoint_dir(save, iters - iters % save_interval), "manifest.json")) as f:
            files = list(json.load(f)["files"].values())
        result["ckpt_bytes_total"] = sum(f["size"] + f["state_size"] for f in files)
        result["ckpt_bytes_per_rank"] = result["ckpt_bytes_total"] / len(files)
    return result


def run(iters: int = 12, nproc: int = 2, warmup: int = 3, workdir: str | None = None,
        host_cache_gb: float = 0.5) -> dict:
    with working_dir(workdir, "megatron-ext-bench-train-") as base:
        runs = {}
        for i, mode in enumerate(MODES, 1):
            _progress(f"{i}/3 {mode}: {iters} iterations on {nproc} CPU ranks")
            runs[mode] = run_mode(mode, base, iters, nproc, 1, warmup, host_cache_gb)
        result = {
            "nproc": nproc,
            "iterations_measured": iters - warmup,
            "iter_s_baseline": runs["baseline"]["iter_s"],
            "iter_s_datastates": runs["datastates"]["iter_s"],
            "iter_s_megatron_async": runs["megatron_async"]["iter_s"],
            "blocked_s_datastates": runs["datastates"]["blocked_s"],
            "blocked_s_megatron_async": runs["megatron_async"]["blocked_s"],
            "ckpt_bytes_per_rank": runs["datastates"]["ckpt_bytes_per_rank"],
        }
        result["ratio_iter_datastates_vs_baseline"] = result["iter_s_datastates"] / result["iter_s_baseline"]
        result["ratio_blocked_megatron_vs_datastates"] = (
            result["blocked_s_megatron_async"] / max(result["blocked_s_datastates"], 1e-9))
        return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['nproc']} CPU ranks, {r['ckpt_bytes_per_rank'] / 1e6:.1f} MB checkpoint per rank, "
        f"median of {r['iterations_measured']} iterations",
        f"  no checkpoints          iteration {r['iter_s_baseline'] * 1000:.1f} ms",
        f"  datastates, every iter  iteration {r['iter_s_datastates'] * 1000:.1f} ms, blocked "
        f"{r['blocked_s_datastates'] * 1000:.1f} ms",
        f"  megatron-core async     iteration {r['iter_s_megatron_async'] * 1000:.1f} ms, blocked "
        f"{r['blocked_s_megatron_async'] * 1000:.1f} ms",
        f"  ratios                  datastates/baseline iteration {r['ratio_iter_datastates_vs_baseline']:.3f} "
        f"(target <= 1.05), megatron/datastates blocked {r['ratio_blocked_megatron_vs_datastates']:.1f}x (target >= 5)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench train``."""
    p.add_argument("--iters", type=POSITIVE_INT, default=12)
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks (data parallel)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.iters, args.nproc, workdir=args.dir)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
