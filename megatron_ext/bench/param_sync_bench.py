"""What Megatron-LM's forced parameter all-gather before each save costs, in its own loop.

With the distributed optimizer and ``--overlap-param-gather``, ``save_checkpoint_and_time`` runs
every bucket's parameter all-gather blocking before the save (``force_param_sync``); patch 0004
skips it under ``--use-datastates``, whose copies wait for the next forward pass's all-gathers
instead (``megatron/param_gather.py``). This runs ``pretrain_gpt.py`` at ``--save-interval 1``
with ``--use-datastates`` both ways, in alternating rounds: on the patched checkout, and on a copy
of it with patch 0004 reversed (Megatron-LM's call back in place). From the log: the
``save-checkpoint`` timer (slowest rank; barrier to barrier, so it holds the forced all-gather),
the adapter's own time to record the save, and the iteration time (Megatron-LM stops its clock
during the save). Medians over the iterations after ``WARMUP`` of each run, then over rounds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_ext.arg_types import POSITIVE_INT, number
from megatron_ext.procs import run_logged
from megatron_ext.testing import megatron_lm

NAME = "param-sync"
HELP = ("Megatron-LM's loop with --overlap-param-gather: the save with its forced "
        "parameter all-gather (patches 0001-0003) vs the copies waiting for the "
        "next forward's all-gathers (0004)")

PATCH = "0004-datastates-leave-the-forced-parameter-all-gather-bef.patch"
WARMUP = 3
RUN_TIMEOUT_S = 1200
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
         "--lr-decay-iters", "100", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234"]
FLAGS = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
         "--save-interval", "1", "--use-datastates"]
MODES = ("force_param_sync", "copy_gate")


def figures(log: str) -> dict:
    """Medians, after the warm-up, of the save timer (max over ranks), the recording and the iteration."""
    saves = [float(m.group(1)) for m in re.finditer(r"save-checkpoint \.+: \([\d.]+, ([\d.]+)\)", log)]
    recorded = [float(m.group(1)) * 1e3 for m in re.finditer(r"checkpoint recorded in ([\d.]+)s", log)]
    iters = [float(m.group(1)) for m in re.finditer(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
    if min(len(saves), len(recorded), len(iters)) <= WARMUP:
        raise RuntimeError("the run logged too few iterations (see its log)")
    return {key: statistics.median(values[WARMUP:])
            for key, values in (("save_ms", saves), ("recorded_ms", recorded), ("iter_ms", iters))}


def _without_patch(checkout: Path, workdir: Path) -> Path:
    """A copy of the patched checkout with patch 0004 reversed: Megatron-LM's forced all-gather back."""
    copy = workdir / "Megatron-LM-0001-0003"
    shutil.copytree(checkout, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", ".git", "tests", "docs", "examples"))
    patch = Path(__file__).resolve().parents[2] / "patches" / PATCH
    subprocess.run(["git", "-C", str(copy), "apply", "--reverse", str(patch)], check=True)
    return copy


def measure(workdir: Path, rounds: int, iters: int, nproc: int = 2) -> dict:
    checkout, reason = megatron_lm.find_checkout()
    if checkout is None:
        raise RuntimeError(reason)
    checkouts = {"copy_gate": checkout, "force_param_sync": _without_patch(checkout, workdir)}
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for rnd in range(rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
            run_dir = workdir / f"{mode}{rnd}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            args = [*MODEL, *FLAGS, "--train-iters", str(iters), "--save", str(run_dir / "ckpt")]
            log_path = run_dir / "train.log"
            code = run_logged(megatron_lm.torchrun_command(nproc, args, checkout=checkouts[mode]),
                              megatron_lm.environment(), str(log_path), RUN_TIMEOUT_S)
            if code != 0:
                raise RuntimeError(f"{mode}: exit code {code}, log {log_path}")
            runs[mode].append(figures(log_path.read_text(errors="replace")))
            print(f"[bench param-sync] round {rnd + 1}/{rounds} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
            shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    result = {mode: {key: statistics.median(r[key] for r in runs[mode]) for key in runs[mode][0]} for mode in MODES}
    result["runs"] = runs
    result["save_ms_saved"] = result["force_param_sync"]["save_ms"] - result["copy_gate"]["save_ms"]
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench param-sync``."""
    p.add_argument("--iters", type=number(int, 5), default=14,
                   help="iterations per run, every one saved (default 14)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=2, help="rounds, order reversed every other (default 2)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    with tempfile.TemporaryDirectory(prefix="megatron-ext-param-sync-", dir=args.dir) as tmp:
        result = measure(Path(tmp), args.repeats, args.iters)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("--overlap-param-gather at --save-interval 1, medians (ms):")
    for mode in MODES:
        r = result[mode]
        print(f"  {mode:17s} save-checkpoint {r['save_ms']:8.1f}  recorded by the adapter {r['recorded_ms']:6.1f}"
              f"  iteration {r['iter_ms']:8.1f}")
    print(f"  save-checkpoint time no longer spent: {result['save_ms_saved']:.1f} ms per iteration")
    return 0
