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

``save_call_cpu_s``: the training thread's CPU seconds inside one save call (median), datastates' and
megatron-core's; with a lent GPU that thread launches the kernels, so its milliseconds are the iteration's.

CPU per iteration is rank 0's: its process (training thread and checkpoint threads) and its
child processes (the I/O worker), median of the per-iteration differences; split into the
training thread's and the engine's (the threads it names, ``engine/threads.py``, and the I/O
worker). On a machine whose cores the ranks fill, what a checkpoint takes in CPU comes out of
training; the difference from no checkpoints is the checkpoint's CPU per iteration, a figure
the machine's drift moves less than the wall time.

``--repeats R`` (default 3) runs the three modes R times, each round in the reverse order of the one
before (a VM's speed drifts within minutes); every figure (a ratio: within its round) is the median
over the rounds, with each round's under ``<figure>_by_round`` and their spread (max - min) under
``<figure>_spread``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from megatron_ext.arg_types import POSITIVE_INT
from megatron_ext.bench.common import (DEFAULT_REPEATS, figures_over_rounds, round_order, run_reference_trainer,
                                       working_dir)
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

    def cpu_per_iteration(field: str) -> float | None:
        """Median over the measured iterations of rank 0's CPU in ``field`` (``process_cpu_seconds``)."""
        steps = [r[field] - prev[field] for prev, r in zip(records[warmup - 1:], measured)] if warmup else []
        return statistics.median(steps) if steps else None

    result = {
        "mode": mode, "nproc": nproc, "save_interval": save_interval, "iterations": iters,
        "iterations_measured": len(measured),
        "iter_s": statistics.median(r["iter_time_s"] for r in measured),
        "iter_s_mean": statistics.mean(r["iter_time_s"] for r in measured),
        "blocked_s": statistics.mean(r["ckpt_blocked_s"] for r in measured),
        "end_to_end_s": end - start,
        "cpu_s_per_iter": cpu_per_iteration("cpu_s"),
        "cpu_main_s_per_iter": cpu_per_iteration("cpu_main_s"),
        "cpu_engine_s_per_iter": cpu_per_iteration("cpu_engine_s"),
        # The training thread's CPU inside each save call (its median): what the save costs the thread
        # that launches the kernels on a GPU node (issue 56's target: at most 3 ms for this model).
        "save_call_cpu_s": statistics.median([r["save_call_cpu_s"] for r in measured
                                              if r.get("save_call_cpu_s") is not None] or [None]),
    }
    if mode == "datastates":
        with open(os.path.join(checkpoint_dir(save, iters - iters % save_interval), "manifest.json")) as f:
            files = list(json.load(f)["files"].values())
        result["ckpt_bytes_total"] = sum(f["size"] + f["state_size"] for f in files)
        result["ckpt_bytes_per_rank"] = result["ckpt_bytes_total"] / len(files)
    return result


def round_figures(runs: dict[str, dict]) -> dict:
    """One round's figures from its three runs (``run_mode`` results by mode); ratios within the round."""
    got = {}
    for mode in MODES:
        got[f"iter_s_{mode}"] = runs[mode]["iter_s"]
        got[f"cpu_s_per_iter_{mode}"] = runs[mode]["cpu_s_per_iter"]
    for mode in ("datastates", "megatron_async"):
        got[f"blocked_s_{mode}"] = runs[mode]["blocked_s"]
    got["cpu_main_s_per_iter_baseline"] = runs["baseline"]["cpu_main_s_per_iter"]
    got["cpu_main_s_per_iter_datastates"] = runs["datastates"]["cpu_main_s_per_iter"]
    got["cpu_engine_s_per_iter_datastates"] = runs["datastates"]["cpu_engine_s_per_iter"]
    got["save_call_cpu_s"] = runs["datastates"]["save_call_cpu_s"]
    got["save_call_cpu_s_megatron_async"] = runs["megatron_async"]["save_call_cpu_s"]
    got["ckpt_bytes_per_rank"] = runs["datastates"]["ckpt_bytes_per_rank"]
    got["ratio_iter_datastates_vs_baseline"] = runs["datastates"]["iter_s"] / runs["baseline"]["iter_s"]
    got["ratio_iter_megatron_async_vs_baseline"] = runs["megatron_async"]["iter_s"] / runs["baseline"]["iter_s"]
    got["ratio_blocked_megatron_vs_datastates"] = (runs["megatron_async"]["blocked_s"]
                                                   / max(runs["datastates"]["blocked_s"], 1e-9))
    cpu_base, cpu_ds = runs["baseline"]["cpu_s_per_iter"], runs["datastates"]["cpu_s_per_iter"]
    both = cpu_base is not None and cpu_ds is not None
    got["ratio_cpu_datastates_vs_baseline"] = cpu_ds / cpu_base if both and cpu_base else None
    got["datastates_cpu_s_per_gb"] = (cpu_ds - cpu_base) / (got["ckpt_bytes_per_rank"] / 1e9) if both else None
    return got


def run(iters: int = 12, nproc: int = 2, warmup: int = 3, workdir: str | None = None,
        host_cache_gb: float = 0.5, repeats: int = DEFAULT_REPEATS) -> dict:
    load_before = list(os.getloadavg())
    with working_dir(workdir, "megatron-ext-bench-train-") as base:
        rounds = []
        for k in range(repeats):
            runs = {}
            for i, mode in enumerate(round_order(MODES, k), 1):
                _progress(f"round {k + 1}/{repeats}, {i}/3 {mode}: {iters} iterations on {nproc} CPU ranks")
                runs[mode] = run_mode(mode, os.path.join(base, f"round{k + 1}"), iters, nproc, 1, warmup, host_cache_gb)
            rounds.append(round_figures(runs))
    result = {"nproc": nproc, "repeats": repeats, "iterations_measured": iters - warmup,
              "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
              **figures_over_rounds(rounds)}
    # The name before issue 56 (tests and docs of older runs read it).
    result["round_ratios_iter_datastates_vs_baseline"] = result["ratio_iter_datastates_vs_baseline_by_round"]
    return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['nproc']} CPU ranks, {r['ckpt_bytes_per_rank'] / 1e6:.1f} MB checkpoint per rank, "
        f"median of {r['iterations_measured']} iterations, {r['repeats']} round(s); load average "
        f"{r['load_average_before'][0]:.2f}",
        f"  no checkpoints          iteration {r['iter_s_baseline'] * 1000:.1f} ms",
        f"  datastates, every iter  iteration {r['iter_s_datastates'] * 1000:.1f} ms, blocked "
        f"{r['blocked_s_datastates'] * 1000:.1f} ms",
        f"  megatron-core async     iteration {r['iter_s_megatron_async'] * 1000:.1f} ms, blocked "
        f"{r['blocked_s_megatron_async'] * 1000:.1f} ms",
        f"  CPU per iteration       rank 0 and its I/O worker: none {r['cpu_s_per_iter_baseline'] * 1000:.0f} ms, "
        f"datastates {r['cpu_s_per_iter_datastates'] * 1000:.0f} ms ({r['datastates_cpu_s_per_gb'] or float('nan'):.3f} s per GB "
        f"checkpointed), megatron-core async {r['cpu_s_per_iter_megatron_async'] * 1000:.0f} ms",
        f"  of which                training thread: none {r['cpu_main_s_per_iter_baseline'] * 1000:.0f} ms, datastates "
        f"{r['cpu_main_s_per_iter_datastates'] * 1000:.0f} ms; datastates' own threads and I/O worker "
        f"{r['cpu_engine_s_per_iter_datastates'] * 1000:.0f} ms",
        f"  save call               the training thread's CPU per call: datastates {r['save_call_cpu_s'] * 1000:.1f} ms "
        f"(target <= 3), megatron-core async {r['save_call_cpu_s_megatron_async'] * 1000:.1f} ms",
        f"  ratios                  datastates/baseline iteration {r['ratio_iter_datastates_vs_baseline']:.3f} "
        f"(target <= 1.05; rounds {', '.join(f'{x:.3f}' for x in r['round_ratios_iter_datastates_vs_baseline'])}), "
        f"CPU {r['ratio_cpu_datastates_vs_baseline'] or float('nan'):.3f}, "
        f"megatron/datastates blocked {r['ratio_blocked_megatron_vs_datastates']:.1f}x (target >= 5)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench train``."""
    p.add_argument("--iters", type=POSITIVE_INT, default=12)
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks (data parallel)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help="rounds of the three modes, each in the reverse order of the one before (figures: medians; "
                        f"default {DEFAULT_REPEATS})")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.iters, args.nproc, workdir=args.dir, repeats=args.repeats)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
