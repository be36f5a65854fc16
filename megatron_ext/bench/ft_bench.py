"""What nvidia-resiliency-ext's rank monitor sees of Megatron-LM's loop: no checkpoints vs one every iteration.

Each mode is one job of ``pretrain_gpt.py`` on CPU ranks under ``ft_launcher`` with
``--enable-ft-package`` (the monitors of Megatron-LM's documented example timeouts), same model,
seed and flags:

* ``none``: ``--use-datastates`` with no save before the end (``--save-interval`` past the run);
* ``datastates``: ``--use-datastates --save-interval 1``;
* ``torch_dist``: Megatron-LM's own synchronous ``torch_dist`` save every iteration, for reference.

Every section message a rank sends its monitor is timed on the training thread when it is sent
(the harness's ``--record-ft``). From them, per rank, after ``warmup`` steps and up to the last
step: the ``step`` sections (what the step timeout watches: forward, backward, the lazy wait and
the optimizer), the ``checkpointing`` sections (the save call and each iteration's finalize),
the intervals with no section open (the out-of-section timeout's) and the longest silence (the
longest time between two messages: how late the monitor hears from a rank at worst). The modes
alternate over ``--repeats`` rounds (the order reversed every other round); figures are medians
over every round's sections, with each round's (``*_by_round``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from megatron_ext.bench.common import DEFAULT_REPEATS, round_order, working_dir
from megatron_ext.bench.megatron_e2e_bench import MODELS, add_job_arguments
from megatron_ext.procs import run_logged
from megatron_ext.testing import megatron_lm

NAME = "ft-heartbeats"
HELP = ("Megatron-LM's pretrain_gpt.py under nvidia-resiliency-ext's ft_launcher (2 CPU ranks): what the rank "
        "monitors see (step sections, out-of-section gaps, the longest silence) with no checkpoints, datastates "
        "and torch_dist every iteration")

MODES = ("none", "datastates", "torch_dist")
#: Megatron-LM's ft_integration docstring's example: what a user starts from.
FT_OPTIONS = ["--ft-rank-section-timeouts", "setup:600,step:180,checkpointing:420",
              "--ft-rank-out-of-section-timeout", "300"]
FIGURES = ("step_s", "checkpointing_s", "out_of_section_s", "silence_s")
RUN_TIMEOUT_S = 1800


def _progress(msg: str) -> None:
    print(f"[bench {NAME}] {msg}", file=sys.stderr, flush=True)


def _saves(mode: str, iters: int) -> list[str]:
    if mode == "torch_dist":
        return ["--ckpt-format", "torch_dist", "--save-interval", "1"]
    return ["--use-datastates", "--save-interval", "1" if mode == "datastates" else str(iters + 1)]


def monitor_view(messages: list[dict], warmup: int) -> dict[str, list[float]]:
    """One rank's section messages (``{"t", "section", "action"}``, in order) as what its monitor times.

    Kept: the span from the close of the ``warmup``-th ``step`` section to the close of the last one.
    """
    closes = [i for i, m in enumerate(messages) if m["section"] == "step" and m["action"] == "close"]
    if len(closes) <= warmup:
        raise ValueError(f"{len(closes)} step sections, none after the {warmup} left out")
    kept = messages[closes[warmup - 1] if warmup else 0: closes[-1] + 1]
    view: dict[str, list[float]] = {name: [] for name in FIGURES}
    opened: dict[str, float] = {}
    left_all = None if warmup == 0 else kept[0]["t"]  # a step just closed: nothing else open in Megatron-LM's loop
    for before, m in zip([None, *kept], kept):
        if before is not None:
            view["silence_s"].append(m["t"] - before["t"])
        if m["action"] == "open":
            if not opened and left_all is not None:
                view["out_of_section_s"].append(m["t"] - left_all)
            opened[m["section"]] = m["t"]
        elif m["section"] in opened:
            start = opened.pop(m["section"])
            if m["section"] in ("step", "checkpointing"):
                view[f"{m['section']}_s"].append(m["t"] - start)
            if not opened:
                left_all = m["t"]
    return view


def run_mode(mode: str, base: Path, checkout: Path, iters: int, warmup: int, model: list[str], nproc: int,
             name: str) -> dict:
    """One job: every rank's monitor view, merged over the ranks."""
    run_dir = base / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    record = run_dir / "ft.jsonl"
    args = [*model, "--train-iters", str(iters), "--save", str(run_dir / "ckpt"), *_saves(mode, iters),
            "--enable-ft-package", "--ft-num-warmup-iters", "1"]
    cmd = megatron_lm.torchrun_command(nproc, args, checkout, ft_launcher=FT_OPTIONS, record_ft=str(record))
    log_path = run_dir / "train.log"
    code = run_logged(cmd, megatron_lm.environment(nvrx=True), str(log_path), RUN_TIMEOUT_S)
    if code != 0:
        log = log_path.read_text(errors="replace")
        tail = "\n".join(line for line in log.splitlines() if "....." not in line)[-3000:]
        raise RuntimeError(f"{mode}: the job exited with {code} (log {log_path})\n$ {' '.join(cmd)}\n{tail}")
    view: dict[str, list[float]] = {name: [] for name in FIGURES}
    for rank in range(nproc):
        lines = Path(f"{record}.{rank}").read_text().splitlines()
        for figure, values in monitor_view([json.loads(line) for line in lines], warmup).items():
            view[figure] += values
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    return view


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "max": max(values), "n": len(values)} if values else {"n": 0}


def run(iters: int = 12, warmup: int = 3, size: str = "default", workdir: str | None = None, nproc: int = 2,
        modes: tuple[str, ...] = MODES, repeats: int = DEFAULT_REPEATS) -> dict:
    missing = megatron_lm.nvrx_missing()
    if missing:
        raise RuntimeError(missing)
    if warmup >= iters - 1:
        raise ValueError(f"--warmup {warmup} leaves too few steps of {iters} to measure")
    checkout, reason = megatron_lm.find_checkout()
    if checkout is None:
        raise RuntimeError(reason)
    load_before = os.getloadavg()
    by_round: dict[str, list[dict]] = {mode: [] for mode in modes}
    with working_dir(workdir, "megatron-ext-bench-ft-") as base:
        for rnd in range(repeats):
            for i, mode in enumerate(round_order(modes, rnd), 1):
                _progress(f"round {rnd + 1}/{repeats}, {i}/{len(modes)} {mode}: {iters} iterations on {nproc} "
                          f"CPU ranks under ft_launcher ({size} model)")
                view = run_mode(mode, Path(base), checkout, iters, warmup, MODELS[size], nproc, f"{mode}-{rnd}")
                by_round[mode].append(view)
                _progress(f"{mode}: step median {statistics.median(view['step_s']):.3f} s, longest silence "
                          f"{max(view['silence_s']):.3f} s")
    result = {"nproc": nproc, "size": size, "iterations": iters, "warmup": warmup, "repeats": repeats,
              "ft_launcher_options": FT_OPTIONS, "load_average_before": list(load_before),
              "load_average_after": list(os.getloadavg()), "modes": {}}
    for mode, views in by_round.items():
        entry = {}
        for figure in FIGURES:
            entry[figure] = _summary([v for view in views for v in view[figure]])
            entry[f"{figure}_by_round"] = [_summary(view[figure]) for view in views]
            medians = [r["median"] for r in entry[f"{figure}_by_round"] if r["n"]]
            entry[f"{figure}_spread"] = max(medians) - min(medians) if medians else None  # of the rounds' medians
        result["modes"][mode] = entry
    if "none" in by_round:
        none = result["modes"]["none"]
        for mode in by_round:
            if mode != "none":
                m = result["modes"][mode]
                result[f"{mode}_vs_none"] = {
                    "step_median": m["step_s"]["median"] / none["step_s"]["median"],
                    "step_max": m["step_s"]["max"] / none["step_s"]["max"],
                    "silence_max": m["silence_s"]["max"] / none["silence_s"]["max"],
                    "step_median_by_round": [a["median"] / b["median"] for a, b in
                                             zip(m["step_s_by_round"], none["step_s_by_round"])]}
    return result


_LABELS = {"none": "no checkpoints", "datastates": "--use-datastates, every iteration",
           "torch_dist": "torch_dist, every iteration"}


def format_table(r: dict) -> str:
    load = ", ".join(f"{x:.2f}" for x in r["load_average_before"])
    lines = [f"Megatron-LM pretrain_gpt.py under ft_launcher, {r['size']} model, {r['nproc']} CPU ranks; "
             f"seconds as the training thread sent its section messages; medians (max) over {r['repeats']} "
             f"rounds, steps {r['warmup'] + 1}-{r['iterations']}; load average {load}",
             f"  {'mode':34s} {'step':>16s} {'checkpointing':>16s} {'out of section':>16s} {'longest silence':>16s}"]
    for mode, m in r["modes"].items():
        cells = [f"{m[f]['median']:.3f} ({m[f]['max']:.3f})" if m[f]["n"] else "-" for f in FIGURES[:3]]
        lines.append(f"  {_LABELS[mode]:34s} {cells[0]:>16s} {cells[1]:>16s} {cells[2]:>16s} "
                     f"{m['silence_s']['max']:16.3f}")
    for mode in r["modes"]:
        if f"{mode}_vs_none" in r:
            v = r[f"{mode}_vs_none"]
            per_round = ", ".join(f"{x:.3f}" for x in v["step_median_by_round"])
            lines.append(f"  {mode} vs none: step median {v['step_median']:.3f}x (rounds {per_round}), step max "
                         f"{v['step_max']:.3f}x, longest silence {v['silence_max']:.3f}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench ft-heartbeats``."""
    add_job_arguments(p, MODES, 3, "step sections left out, from the first (default 3)")


def main(args) -> int:
    modes = tuple(m for m in MODES if m in args.modes)
    result = run(args.iters, args.warmup, args.size, args.dir, args.nproc, modes, args.repeats)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
