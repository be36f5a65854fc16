"""``megatron-ext bench deepspeed``: DeepSpeed's default (torch.save) engine vs this one, same model, one run.

Three runs of the DeepSpeed harness (2 CPU ranks, ZeRO-1, a checkpoint every step): without
checkpoints, with DeepSpeed's default engine, with ``"datastates_ckpt"``. Iteration time is the
median over the steps after warm-up and includes ``save_checkpoint``. Time blocked is what the
slowest rank waited for checkpointing per step: the ``save_checkpoint`` call, plus for datastates
the lazy wait inside the next optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from megatron_ext.arg_types import POSITIVE_INT
from megatron_ext.bench.common import working_dir
from megatron_ext.procs import torchrun_command

NAME = "deepspeed"
HELP = "DeepSpeed's default checkpoint engine vs datastates, same model"


def _run(args: list[str], log_json: str) -> list[dict]:
    cmd = torchrun_command(2, "-m", "megatron_ext.testing.deepspeed_harness", *args, "--log-json", log_json)
    # DeepSpeed JIT-builds its CPU ops under TORCH_EXTENSIONS_DIR; one per environment, so that two
    # environments on one machine do not rebuild over each other's build behind a shared lock.
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"harness failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    with open(log_json) as f:
        return [json.loads(line) for line in f]


def run(steps: int = 12, hidden: int = 4096, warmup: int = 3, workdir: str | None = None) -> dict:
    with working_dir(workdir, "megatron-ext-bench-ds-") as base:
        common = ["--zero-stage", "1", "--steps", str(steps), "--hidden", str(hidden)]
        modes = {"baseline": ["--no-save", "--save-dir", f"{base}/none"],
                 "torch_engine": ["--engine", "torch", "--save-dir", f"{base}/torch"],
                 "datastates": ["--engine", "datastates", "--save-dir", f"{base}/datastates"]}
        records = {}
        for i, (mode, extra) in enumerate(modes.items(), 1):
            print(f"[bench deepspeed] {i}/3 {mode}: {steps} steps on 2 CPU ranks", file=sys.stderr, flush=True)
            records[mode] = _run([*common, *extra], f"{base}/{mode}.jsonl")[warmup:]

        def med(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in records[mode])

        result = {
            "steps_measured": steps - warmup, "hidden": hidden,
            "baseline_iter_s": med("baseline", "iter_s"),
            "torch_engine_iter_s": med("torch_engine", "iter_s"),
            "datastates_iter_s": med("datastates", "iter_s"),
            "torch_engine_blocked_s": statistics.mean(r["ckpt_blocked_s"] for r in records["torch_engine"]),
            "datastates_blocked_s": statistics.mean(r["ckpt_blocked_s"] for r in records["datastates"]),
        }
        result["ratio_blocked_torch_vs_datastates"] = (result["torch_engine_blocked_s"]
                                                       / max(result["datastates_blocked_s"], 1e-9))
        result["ratio_iter_datastates_vs_baseline"] = result["datastates_iter_s"] / result["baseline_iter_s"]
        return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"DeepSpeed ZeRO-1, 2 CPU ranks, MLP hidden {r['hidden']}, median of {r['steps_measured']} steps",
        f"  no checkpoints        iteration {r['baseline_iter_s'] * 1000:.1f} ms",
        f"  default torch engine  iteration {r['torch_engine_iter_s'] * 1000:.1f} ms, blocked {r['torch_engine_blocked_s'] * 1000:.1f} ms",
        f"  datastates            iteration {r['datastates_iter_s'] * 1000:.1f} ms, blocked {r['datastates_blocked_s'] * 1000:.1f} ms",
        f"  ratios                blocked torch/datastates {r['ratio_blocked_torch_vs_datastates']:.1f}x (target >= 10), "
        f"datastates/baseline iteration {r['ratio_iter_datastates_vs_baseline']:.3f} (target <= 1.05)",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench deepspeed``."""
    p.add_argument("--steps", type=POSITIVE_INT, default=12)
    p.add_argument("--hidden", type=POSITIVE_INT, default=4096, help="MLP width (sets the checkpoint size)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.steps, args.hidden, workdir=args.dir)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
