"""Megatron-LM's ``load_checkpoint``, datastates vs megatron-core ``torch_dist``: same state, same ranks, one run.

Measured through Megatron-LM's own ``pretrain_gpt.py`` (on CPU ranks, ``testing/megatron_lm.py``),
not the reference trainer: its ``load-checkpoint`` timer brackets exactly the call a user's job
makes at start-up (Megatron-LM's own ``torch_dist`` loader on one side, the patched route into
``megatron_ext.megatron.checkpointing`` on the other, with barriers on both ends) and it logs the
slowest rank's time. The reference trainer's torch_dist load is this project's re-implementation of
that path, so it would compare us with ourselves.

1. Two training runs with the same seed and flags write iteration ``ITERS`` once with
   ``--use-datastates`` and once with ``--ckpt-format torch_dist``. Megatron-LM's training is
   deterministic on CPU and both ways resume bit-identically (tests/megatron_lm), so the two
   checkpoints hold the same state; the recorded losses of the two runs are compared to show it.
2. ``repeats`` rounds, each loading both checkpoints (order alternating between rounds) in a fresh
   job with ``--load`` and ``--train-iters ITERS`` (nothing left to train), the checkpoint's pages
   evicted from the page cache before each. The figure per format is the median over rounds.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
from pathlib import Path

from megatron_ext.bench.common import drop_page_cache
from megatron_ext.procs import run_logged
from megatron_ext.testing import megatron_lm

ITERS = 2
#: A GPT of 4 layers, hidden 512, vocab 8192, bf16 with the distributed optimizer: ~240 MB of checkpoint.
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--lr-decay-iters", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
         "--bf16", "--use-distributed-optimizer"]
FORMATS = {"datastates": ["--use-datastates", "--datastates-host-cache-size", "0.25"],
           "torch_dist": ["--ckpt-format", "torch_dist"]}
_TIMER = re.compile(r"load-checkpoint \.*: \(([\d.]+), ([\d.]+)\)")
RUN_TIMEOUT_S = 1200


def _progress(msg: str) -> None:
    print(f"[bench megatron-load] {msg}", file=sys.stderr, flush=True)


def load_timer_s(log: str) -> float:
    """The slowest rank's ``load-checkpoint`` time from a Megatron-LM log, in seconds."""
    found = _TIMER.findall(log)
    if not found:
        raise RuntimeError("no load-checkpoint timer in the Megatron-LM log")
    return float(found[-1][1]) / 1000


def _run(checkout: Path, nproc: int, args: list[str], workdir: str, name: str, record: str | None = None) -> str:
    log_path = os.path.join(workdir, f"{name}.log")
    cmd = megatron_lm.torchrun_command(nproc, args, checkout, record=record)
    code = run_logged(cmd, megatron_lm.environment(), log_path, RUN_TIMEOUT_S)
    with open(log_path, errors="replace") as f:
        log = f.read()
    if code != 0:
        tail = "\n".join(line for line in log.splitlines() if "....." not in line)[-4000:]
        raise RuntimeError(f"{name}: Megatron-LM exited with {code}\n$ {' '.join(cmd)}\n{tail}")
    return log


def measure(workdir: str, nproc: int = 2, repeats: int = 3, model: list[str] = MODEL,
            checkout: Path | None = None) -> dict:
    """Save once per format, then time ``repeats`` cold loads of each; medians and every repetition."""
    if checkout is None:
        checkout, reason = megatron_lm.find_checkout()
        if checkout is None:
            return {"megatron_load_skipped": reason}
    os.makedirs(workdir, exist_ok=True)
    saved: dict[str, str] = {}
    losses: dict[str, list] = {}
    for fmt, flags in FORMATS.items():
        _progress(f"training {ITERS} iterations on {nproc} ranks and saving with {fmt}")
        saved[fmt] = os.path.join(workdir, f"ckpt-{fmt}")
        record = os.path.join(workdir, f"train-{fmt}.jsonl")
        if os.path.exists(record):
            os.unlink(record)
        _run(checkout, nproc, [*model, *flags, "--train-iters", str(ITERS), "--save", saved[fmt],
                               "--save-interval", str(ITERS)], workdir, f"train-{fmt}", record)
        losses[fmt] = [(r["iteration"], r["loss"], r["grad_norm"]) for r in megatron_lm.read_records(record)]
    seconds: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for rep in range(repeats):
        for fmt in (list(FORMATS) if rep % 2 == 0 else list(FORMATS)[::-1]):
            _progress(f"round {rep + 1}/{repeats}: Megatron-LM load_checkpoint of the {fmt} checkpoint (cold)")
            # --use-datastates needs --save; a scratch directory, so nothing is written next to the checkpoint.
            extra = (["--save", os.path.join(workdir, "scratch"), "--save-interval", str(ITERS)]
                     if fmt == "datastates" else [])
            drop_page_cache(saved[fmt])
            log = _run(checkout, nproc, [*model, *FORMATS[fmt], "--train-iters", str(ITERS), "--load", saved[fmt],
                                         *extra], workdir, f"load-{fmt}-{rep}")
            seconds[fmt].append(load_timer_s(log))
    result = {
        "megatron_nproc": nproc,
        "megatron_ckpt_bytes_datastates": _tree_bytes(saved["datastates"]),
        "megatron_ckpt_bytes_torch_dist": _tree_bytes(saved["torch_dist"]),
        "megatron_same_training": losses["datastates"] == losses["torch_dist"] and bool(losses["datastates"]),
        "megatron_load_s_datastates": statistics.median(seconds["datastates"]),
        "megatron_load_s_torch_dist": statistics.median(seconds["torch_dist"]),
        "megatron_load_s_datastates_runs": seconds["datastates"],
        "megatron_load_s_torch_dist_runs": seconds["torch_dist"],
    }
    result["megatron_load_speedup"] = result["megatron_load_s_torch_dist"] / result["megatron_load_s_datastates"]
    return result


def _tree_bytes(root: str) -> int:
    """Bytes of the checkpoint files under ``root`` (telemetry logs excluded)."""
    total = 0
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "datastates_telemetry"]
        total += sum(os.path.getsize(os.path.join(parent, n)) for n in names)
    return total
