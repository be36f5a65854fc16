"""Megatron-LM's own ``pretrain_gpt.py`` end to end: no checkpoints vs a checkpoint every iteration.

Each mode is one job on CPU ranks (``testing/megatron_lm.py``), same model, seed and flags:

* ``none``: no ``--save``;
* ``datastates``: ``--use-datastates --save-interval 1`` (host cache: the default, ``auto``);
* ``torch_dist``: Megatron-LM's own ``torch_dist`` save, synchronous, every iteration;
* ``torch_dist_async``: the same with ``--async-save --use-persistent-ckpt-worker --async-strategy
  mcore`` (megatron-core's async strategy; Megatron-LM switches ``--async-save`` off without the
  persistent worker, and ``nvrx`` needs nvidia-resiliency-ext). Its worker process gets the ranks'
  CPU answers from ``testing/async_save_worker.py``; on CPU ranks its host copy copies nothing;
* ``torch_dist_async_constant``: the same plus ``--ckpt-assume-constant-structure`` (the save plans
  cached after the first save): Megatron-LM's best setting for its own async save.

Megatron-LM's NVRx async strategy (``--async-strategy nvrx``, with and without
``--ckpt-assume-constant-structure``) is not run: the JSON's ``peers_not_run`` says why
(``PEERS_NOT_RUN``). A mode that fails is not dropped either: ``skipped`` names it with the reason.

**How an iteration is timed.** Megatron-LM's "elapsed time per iteration" stops its timer around
the save (``save_checkpoint_and_time``), so it cannot see what a checkpoint costs. Here the time of
iteration ``k`` is the wall time between the log lines of iterations ``k - 1`` and ``k``, read from
the timestamps (microseconds) Megatron-LM writes at the start of each line (``--log-interval 1``):
it holds iteration ``k - 1``'s save and everything that save leaves to iteration ``k`` (the lazy
wait in the optimizer step, the async save's finalize). Iteration 1 has no such time (start-up);
iteration 2 holds the first save (datastates creates its engine, the async worker its first
request); the median is over the iterations after ``warmup`` (default 3: iterations 4 on).
Megatron-LM's own figure is reported beside it (``megatron_elapsed_s``). ``--repeats R`` runs every
mode R times, the order reversed every other round, and takes the medians over all rounds: the
machine's load drifts between jobs (2 shared cores).

The default model is Llama-style (``LLAMA_STYLE``: SwiGLU, RMSNorm, rotary, GQA, untied
embeddings), bf16 with the distributed optimizer on 2 ranks: about 150 MB of datastates checkpoint
per rank per iteration.

Per mode, ``iter_s`` is the median over every round's measured iterations, ``iter_s_by_round``
each round's median and ``iter_s_spread`` their max - min (likewise at the top level
``iter_s_<mode>``, and ``ratio_<mode>_vs_none_by_round``: each round's ratio).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

from megatron_ext.arg_types import NONNEG_INT, POSITIVE_INT, number
from megatron_ext.bench.common import DEFAULT_REPEATS, figure_over_rounds, round_order, working_dir
from megatron_ext.engine.files import tree_bytes
from megatron_ext.procs import run_logged
from megatron_ext.testing import megatron_lm

NAME = "megatron-e2e"
HELP = ("Megatron-LM's pretrain_gpt.py (Llama-style, 2 CPU ranks): seconds per iteration with no checkpoints, "
        "datastates, torch_dist and torch_dist --async-save (plain and with cached plans) every iteration")

MODES = ("none", "datastates", "torch_dist", "torch_dist_async", "torch_dist_async_constant")
SAVES = {"none": [],
         "datastates": ["--use-datastates"],
         "torch_dist": ["--ckpt-format", "torch_dist"],
         "torch_dist_async": ["--ckpt-format", "torch_dist", "--async-save", "--use-persistent-ckpt-worker",
                              "--async-strategy", "mcore"]}
SAVES["torch_dist_async_constant"] = [*SAVES["torch_dist_async"], "--ckpt-assume-constant-structure"]
_NVRX_REASON = ("megatron-core 0.19's NVRx async strategy requires nvidia-resiliency-ext >= 0.6.0 "
                "(megatron/core/dist_checkpointing/strategies/nvrx.py, NVRX_MIN_VERSION); the package registry "
                "offers at most 0.4.1 for Python 3.12, installed apart in <venv>/nvrx for the fault-tolerance tests "
                "only (importing megatron-core beside it fails)")
#: Megatron-LM's own settings of its async save this bench cannot run here, and why (in the JSON).
PEERS_NOT_RUN = {
    "torch_dist_async_nvrx": {
        "flags": "--ckpt-format torch_dist --async-save --use-persistent-ckpt-worker --async-strategy nvrx",
        "reason": _NVRX_REASON},
    "torch_dist_async_nvrx_constant": {
        "flags": "--ckpt-format torch_dist --async-save --use-persistent-ckpt-worker --async-strategy nvrx "
                 "--ckpt-assume-constant-structure",
        "reason": _NVRX_REASON},
}
TIMING = ("seconds per iteration: wall time between consecutive iteration log lines of Megatron-LM "
          "(their timestamps, parsed from the log), so each holds the previous iteration's save")
#: Targets on 2 CPU cores (issue 41).
TARGET_VS_NONE = 1.10
TARGET_VS_TORCH_DIST = 2.0


def _with(flags: list[str], **values: str) -> list[str]:
    """``flags`` with the given options' values replaced (``num_layers="8"`` sets ``--num-layers 8``)."""
    out = list(flags)
    for name, value in values.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = value
    return out


_COMMON = ["--bf16", "--use-distributed-optimizer", *megatron_lm.LLAMA_STYLE]
#: ``default``: ~150 MB of checkpoint per rank (21M parameters); ``tiny``: the tests' GPT, for a fast check.
MODELS = {
    "default": [*_with(megatron_lm.TINY_GPT, num_layers="4", hidden_size="512", num_attention_heads="8",
                       seq_length="256", max_position_embeddings="256", micro_batch_size="4",
                       global_batch_size="8", vocab_size="10240", lr_decay_iters="100"), *_COMMON],
    "tiny": [*megatron_lm.TINY_GPT, *_COMMON],
}
RUN_TIMEOUT_S = 1800
# Not anchored at the line's start: another rank's output can land in front of it (rank 0's memory
# report, written at the same moment); Megatron-LM's own figure is optional for the same reason.
_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/\s*\d+ \|"
                   r"(?:.*?elapsed time per iteration \(ms\): ([\d.]+))?")


def _progress(msg: str) -> None:
    print(f"[bench megatron-e2e] {msg}", file=sys.stderr, flush=True)


def iteration_times(log: str) -> dict[int, tuple[float, float | None]]:
    """Iteration ``k`` -> (seconds between the log lines of ``k - 1`` and ``k``, Megatron-LM's own seconds or
    None where its line was cut), for every ``k`` whose predecessor was logged too."""
    stamps: dict[int, tuple[datetime.datetime, float | None]] = {}
    for when, iteration, elapsed_ms in _LINE.findall(log):
        stamps[int(iteration)] = (datetime.datetime.fromisoformat(when), float(elapsed_ms) / 1e3 if elapsed_ms else None)
    return {k: ((stamps[k][0] - stamps[k - 1][0]).total_seconds(), stamps[k][1])
            for k in sorted(stamps) if k - 1 in stamps}


def launch(label: str, run_dir: Path, checkout: Path, args: list[str], nproc: int,
           env: dict | None = None) -> tuple[str, list[dict]]:
    """One ``pretrain_gpt.py`` job on ``nproc`` CPU ranks with ``args`` (``run_dir`` made afresh, its
    log ``train.log``): the log's text and rank 0's save calls (``{iteration, cpu_s, wall_s, started_at}``, one per
    ``save_checkpoint`` call of the loop). ``env``: the job's environment (default
    ``megatron_lm.environment()``). A job that fails raises ``RuntimeError`` with the log's tail."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log_path = run_dir / "train.log"
    save_cpu = run_dir / "save_cpu.jsonl"
    cmd = megatron_lm.torchrun_command(nproc, args, checkout, record_save_cpu=str(save_cpu))
    code = run_logged(cmd, megatron_lm.environment() if env is None else env, str(log_path), RUN_TIMEOUT_S)
    log = log_path.read_text(errors="replace")
    if code != 0:
        tail = "\n".join(line for line in log.splitlines() if "....." not in line)[-3000:]
        raise RuntimeError(f"{label}: Megatron-LM exited with {code} (log {log_path})\n$ {' '.join(cmd)}\n{tail}")
    rows = Path(f"{save_cpu}.0")
    calls = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []
    return log, calls


def run_mode(mode: str, base: Path, checkout: Path, iters: int, warmup: int, model: list[str], nproc: int,
             name: str | None = None) -> dict:
    """One job in ``mode`` (in ``base / name``): every iteration's time, the median after ``warmup``, one
    checkpoint's size."""
    run_dir = base / (name or mode)
    save = run_dir / "ckpt"
    args = [*model, "--train-iters", str(iters), *SAVES[mode]]
    if mode != "none":
        args += ["--save", str(save), "--save-interval", "1"]
    log, calls = launch(mode, run_dir, checkout, args, nproc)
    log_path = run_dir / "train.log"
    times = iteration_times(log)
    measured = {k: t for k, t in times.items() if k > warmup}
    if not measured:
        raise RuntimeError(f"{mode}: no iteration after the warm-up was timed (log {log_path})")
    result = {"iter_s": statistics.median(t for t, _ in measured.values()),
              "megatron_elapsed_s": statistics.median([e for _, e in measured.values() if e is not None] or [0.0]),
              "iterations_timed": list(measured), "iter_s_runs": [t for t, _ in measured.values()],
              "iter_s_warmup": {k: t for k, (t, _) in times.items() if k <= warmup}}
    kept = [c["cpu_s"] for c in calls if c["iteration"] > warmup]
    result["save_call_cpu_s"] = statistics.median(kept) if kept else None  # rank 0's training thread
    if mode != "none":
        last = save / f"iter_{iters:07d}"
        result["ckpt_bytes_per_rank"] = tree_bytes(str(last)) / nproc if last.is_dir() else None
        shutil.rmtree(save, ignore_errors=True)  # 12 checkpoints of 300 MB per mode otherwise
    return result


def run(iters: int = 12, warmup: int = 3, size: str = "default", workdir: str | None = None, nproc: int = 2,
        modes: tuple[str, ...] = MODES, repeats: int = DEFAULT_REPEATS) -> dict:
    """Every mode in turn, ``repeats`` rounds (the order reversed every other round, so that a drift of the
    machine's load weighs on every mode alike); per mode the median over every round's measured iterations."""
    if warmup >= iters:
        raise ValueError(f"--warmup {warmup} leaves no iteration of {iters} to measure")
    checkout, reason = megatron_lm.find_checkout()
    if checkout is None:
        raise RuntimeError(reason)
    load_before = os.getloadavg()
    with working_dir(workdir, "megatron-ext-bench-e2e-") as base:
        rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
        skipped: dict[str, str] = {}
        for rnd in range(repeats):
            for i, mode in enumerate(round_order(modes, rnd), 1):
                if mode in skipped:
                    continue
                _progress(f"round {rnd + 1}/{repeats}, {i}/{len(modes)} {mode}: {iters} iterations on {nproc} CPU "
                          f"ranks ({size} model)")
                try:
                    got = run_mode(mode, Path(base), checkout, iters, warmup, MODELS[size], nproc, f"{mode}-{rnd}")
                except RuntimeError as exc:
                    if mode in ("none", "datastates"):
                        raise
                    skipped[mode] = f"round {rnd + 1}: {_failure(str(exc))}"
                    _progress(f"{mode} skipped: {skipped[mode]}")
                    continue
                rounds[mode].append(got)
                _progress(f"{mode}: {got['iter_s']:.3f} s per iteration")
        runs = {mode: _merged(got) for mode, got in rounds.items() if mode not in skipped}
    result = {"nproc": nproc, "size": size, "iterations": iters, "warmup": warmup, "repeats": repeats,
              "iterations_measured": iters - warmup, "timing": TIMING,
              "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
              "targets": {"datastates_vs_none": TARGET_VS_NONE, "torch_dist_vs_datastates": TARGET_VS_TORCH_DIST},
              "modes": runs, "skipped": skipped, "peers_not_run": PEERS_NOT_RUN}
    for mode, r in runs.items():
        if mode != "none":
            result[f"save_call_cpu_s_{mode}"] = r["save_call_cpu_s"]
        result[f"iter_s_{mode}"] = r["iter_s"]
        result[f"iter_s_{mode}_by_round"] = r["iter_s_by_round"]
        result[f"iter_s_{mode}_spread"] = r["iter_s_spread"]
    if "none" in runs:
        for mode in runs:
            if mode != "none":
                result[f"ratio_{mode}_vs_none"] = runs[mode]["iter_s"] / runs["none"]["iter_s"]
                paired = figure_over_rounds("ratio", [a / b for a, b in zip(runs[mode]["iter_s_by_round"],
                                                                             runs["none"]["iter_s_by_round"])])
                result[f"ratio_{mode}_vs_none_by_round"] = paired["ratio_by_round"]
                result[f"ratio_{mode}_vs_none_spread"] = paired["ratio_spread"]
    if "datastates" in runs:
        result["ckpt_bytes_per_rank"] = runs["datastates"]["ckpt_bytes_per_rank"]
        if "torch_dist" in runs:
            result["speedup_datastates_vs_torch_dist"] = runs["torch_dist"]["iter_s"] / runs["datastates"]["iter_s"]
    return result


def _failure(message: str) -> str:
    """The gist of a failed job's error: its first line and the last traceback line of its log tail."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return f"{lines[0]}: {errors[-1]}" if errors and lines else (lines[0] if lines else "failed")


def _merged(rounds: list[dict]) -> dict:
    """One mode's rounds as one: medians over all their measured iterations, each round's median and their
    spread, each round kept."""
    merged = {"iter_s": statistics.median(t for r in rounds for t in r["iter_s_runs"]),
              **{k: v for k, v in figure_over_rounds("iter_s", [r["iter_s"] for r in rounds]).items() if k != "iter_s"},
              **figure_over_rounds("megatron_elapsed_s", [r["megatron_elapsed_s"] for r in rounds]),
              **figure_over_rounds("save_call_cpu_s", [r.get("save_call_cpu_s") for r in rounds]),
              "iterations_timed": [k for r in rounds for k in r["iterations_timed"]],
              "iter_s_runs": [t for r in rounds for t in r["iter_s_runs"]], "rounds": rounds}
    if "ckpt_bytes_per_rank" in rounds[0]:
        merged["ckpt_bytes_per_rank"] = rounds[0]["ckpt_bytes_per_rank"]
    return merged


_LABELS = {"none": "no checkpoints", "datastates": "--use-datastates, every iteration",
           "torch_dist": "torch_dist, every iteration", "torch_dist_async": "torch_dist --async-save, every iter.",
           "torch_dist_async_constant": "the same, cached plans (constant struct.)"}


def format_table(r: dict) -> str:
    size = f", {r['ckpt_bytes_per_rank'] / 1e6:.0f} MB of datastates checkpoint per rank" if r.get(
        "ckpt_bytes_per_rank") else ""
    load = ", ".join(f"{x:.2f}" for x in r["load_average_before"])
    rounds = f" of {r['repeats']} rounds" if r.get("repeats", 1) > 1 else ""
    left_out = "iteration 1: start-up"
    if r["warmup"] >= 2:
        left_out += f"; iterations 2-{r['warmup']}: the first saves (engine and worker creation)"
    lines = [f"Megatron-LM pretrain_gpt.py, {r['size']} Llama-style model, {r['nproc']} CPU ranks{size}",
             f"{r['timing']}; median of iterations {r['warmup'] + 1}-{r['iterations']}{rounds} ({left_out}, "
             f"left out); load average {load}",
             f"  {'mode':38s} {'s/iteration':>11s} {'vs none':>8s} {'Megatron timer':>15s} {'save call CPU':>14s}"]
    for mode, m in r["modes"].items():
        ratio = r.get(f"ratio_{mode}_vs_none")
        save_cpu = m.get("save_call_cpu_s")
        lines.append(f"  {_LABELS[mode]:38s} {m['iter_s']:11.3f} {f'{ratio:.3f}x' if ratio else '':>8s} "
                     f"{m['megatron_elapsed_s']:14.3f}s {f'{save_cpu * 1e3:.1f} ms' if save_cpu else '':>14s}")
    if "ratio_datastates_vs_none" in r:
        ok = r["ratio_datastates_vs_none"] <= TARGET_VS_NONE
        lines.append(f"  target: datastates <= {TARGET_VS_NONE:.2f}x of none: {r['ratio_datastates_vs_none']:.3f}x "
                     f"({'met' if ok else 'NOT met'})")
    if "speedup_datastates_vs_torch_dist" in r:
        ok = r["speedup_datastates_vs_torch_dist"] >= TARGET_VS_TORCH_DIST
        lines.append(f"  target: datastates >= {TARGET_VS_TORCH_DIST:.0f}x faster than torch_dist every iteration: "
                     f"{r['speedup_datastates_vs_torch_dist']:.2f}x ({'met' if ok else 'NOT met'})")
    for mode, reason in r.get("skipped", {}).items():
        lines.append(f"  {mode}: failed, not run: {reason}")
    for name, peer in r.get("peers_not_run", {}).items():
        lines.append(f"  not run: {peer['flags']}: {peer['reason']}")
    lines.append("  (Megatron timer: its 'elapsed time per iteration', which stops around the save; save call CPU: "
                 "rank 0's training thread inside each save_checkpoint call, median)")
    return "\n".join(lines)


def add_job_arguments(p: argparse.ArgumentParser, modes: tuple[str, ...], min_iters: int, warmup_help: str) -> None:
    """The options of the benches that run Megatron-LM's own loop (this one and ``ft-heartbeats``)."""
    p.add_argument("--iters", type=number(int, min_iters), default=12, help="iterations per job (default 12)")
    p.add_argument("--warmup", type=NONNEG_INT, default=3, help=warmup_help)
    p.add_argument("--size", choices=tuple(MODELS), default="default",
                   help="default: ~150 MB of checkpoint per rank; tiny: the tests' GPT, a quick check")
    p.add_argument("--modes", nargs="+", choices=modes, default=list(modes), help="modes to run (default all)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help=f"rounds of every mode, order reversed every other; medians over all (default {DEFAULT_REPEATS})")
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks (data parallel, default 2)")
    p.add_argument("--dir", default=None, help="work directory, kept (default: a temporary one here, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench megatron-e2e``."""
    add_job_arguments(p, MODES, 2, "iterations left out of the median, from the first (default 3)")


def main(args) -> int:
    modes = tuple(m for m in MODES if m in args.modes)
    result = run(args.iters, args.warmup, args.size, args.dir, args.nproc, modes, args.repeats)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
