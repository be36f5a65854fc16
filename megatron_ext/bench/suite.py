"""``megatron-ext bench suite``: the paper's scenarios scaled to a CPU, every peer, one run, one report.

Scenarios (each measured against the peers in the same run, so the ratios mean something even
though absolute figures drift on a shared machine):

* **physical limits**: memcpy and single-thread O_DIRECT write, before and after the size sweep;
* **sizes**: seconds training is blocked and seconds until the checkpoint is durable, of the engine
  at several state sizes vs ``torch.save`` + fsync (what DeepSpeed's default engine does) and DCP
  ``async_save`` with the thread and the process executor (``engine_bench``'s measuring functions),
  each beside its limit: a memcpy of the state (what a blocking snapshot costs at least) and an
  O_DIRECT write of it (the disk's time for those bytes);
* **every iteration**: the reference trainer (megatron-core GPT) without checkpoints, with
  ``--use-datastates`` and with megatron-core's async ``dist_checkpointing`` save (``train_bench``);
* **frequency**: the same, every 10, 5, 2, 1 iterations, end-to-end time until the last commit;
* **data parallel**: DP 1, 2, 4 ranks, checkpoint every iteration, seconds blocked per iteration;
* **DeepSpeed**: its default engine vs ``datastates`` in the DeepSpeed harness (``deepspeed_bench``);
* **GPU model**: the measured figures fed into ``gpu_model`` for 70B on 180 A100s.

Outputs under ``--out``: ``results.json`` (every raw figure, rewritten after each scenario),
``results.md`` (tables), PNG plots, and ``telemetry/`` (``telemetry report`` of the
every-iteration datastates run).

Figures are seconds: blocked (what training loses) and until durable (how old the newest safe
checkpoint is). "GB/s" appears only for real transfer rates (memcpy, the O_DIRECT write, the
engine's flush, bytes made durable per second); size divided by time *blocked* is not one (it
reaches hundreds of GB/s when the engine blocks for microseconds) and is not reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from megatron_ext.bench import deepspeed_bench, engine_bench, gpu_model, plots, telemetry_report, train_bench
from megatron_ext.bench.common import (direct_write_gbps, ensure_process_group, fresh_dir, make_state, memcpy_gbps,
                                       state_bytes)

NAME = "suite"
HELP = "every scenario against every peer in one run: results.json, results.md, plots"

DCP_EXECUTORS = {"DCP async (thread)": "thread", "DCP async (process)": "process"}
SIZE_APPROACHES = ("datastates", "torch.save", *DCP_EXECUTORS)
QUICK_MODEL = ["--bf16", "--use-distributed-optimizer", "--num-layers", "2", "--hidden-size", "256",
               "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "4096",
               "--micro-batch-size", "2", "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
NOISE_NOTE = ("2 shared CPU cores: the training ranks, the checkpoint threads and other jobs compete for "
              "them, so single figures are noise-bound; compare ratios measured in the same run.")


@dataclass(frozen=True)
class Profile:
    name: str
    sizes_mb: tuple[int, ...]
    train_model: tuple[str, ...]
    train_iters: int
    warmup: int
    ds_steps: int
    ds_hidden: int
    intervals: tuple[int, ...] = (10, 5, 2, 1)
    dp: tuple[int, ...] = (1, 2, 4)


QUICK = Profile("quick", (64, 128, 256), tuple(QUICK_MODEL), train_iters=10, warmup=2, ds_steps=8, ds_hidden=2048)
FULL = Profile("full", (256, 512, 1024, 2048), tuple(train_bench.MODEL), train_iters=20, warmup=3,
               ds_steps=12, ds_hidden=4096)


class Progress:
    """Numbered progress lines on stderr: step, elapsed time, what runs now."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        print(f"[bench suite {self.done:2d}/{self.total}, {time.monotonic() - self.start:6.0f}s] {what}",
              file=sys.stderr, flush=True)


def measure_limits(base: str, nbytes: int) -> dict:
    """memcpy and O_DIRECT write GB/s of ``nbytes`` (the best of two)."""
    return {"memcpy_gbps": memcpy_gbps(), "direct_write_gbps": direct_write_gbps(fresh_dir(base), nbytes)}


def run_sizes(sizes_mb: tuple[int, ...], base: str, progress: Progress | None = None) -> list[dict]:
    """Every approach at every size: seconds blocked, seconds until durable, and the rate at which the
    bytes became durable (size / seconds until durable, a real transfer rate)."""
    os.makedirs(base, exist_ok=True)
    ensure_process_group(base)
    warm = make_state(4 << 20, 1 << 20)
    for executor in DCP_EXECUTORS.values():  # the process executor starts its daemon at the first save
        engine_bench.measure_dcp_async(warm, os.path.join(base, f"warmup-{executor}"), executor)
    rows = []
    for size_mb in sizes_mb:
        state = make_state(size_mb << 20)
        nbytes = state_bytes(state)
        # Compute long enough to hide the copy, so the engine's blocked time is its bookkeeping.
        compute_s = max(0.5, 4 * nbytes / 1e9)
        for approach in SIZE_APPROACHES:
            if progress:
                progress.step(f"sizes: {approach}, {size_mb} MB")
            where = os.path.join(base, f"{''.join(c for c in approach.lower() if c.isalnum())}-{size_mb}")
            if approach == "datastates":
                r = engine_bench.measure_datastates(state, where, compute_s=compute_s)
                # Durable when the flush ends (the engine's telemetry, from the save call); the commit
                # here waits for the caller's compute_s first, so committed_s measures the benchmark.
                blocked, done = r["datastates_blocking_s"], r["datastates_flush_s"]
                extra = {"flush_gbps": r["datastates_flush_gbps"], "save_call_s": r["datastates_save_call_s"],
                         "committed_s": r["datastates_persisted_s"], "compute_s": compute_s}
            elif approach == "torch.save":
                blocked = done = engine_bench.measure_torch_save(state, where)
                extra = {}
            else:
                r = engine_bench.measure_dcp_async(state, where, DCP_EXECUTORS[approach])
                blocked, done, extra = r["blocking_s"], r["done_s"], {}
            rows.append({"size_bytes": nbytes, "size_mb": size_mb, "approach": approach, "blocked_s": blocked,
                         "done_s": done, "durable_gbps": nbytes / done / 1e9, **extra})
            fresh_dir(where)  # keep the disk free for the next approach
        del state
    return rows


def _train(profile: Profile, base: str, progress: Progress, label: str, mode: str, nproc: int,
           interval: int) -> dict:
    progress.step(f"{label}: reference trainer, {mode}, DP {nproc}, every {interval}, {profile.train_iters} iterations")
    return train_bench.run_mode(mode, base, profile.train_iters, nproc, interval, profile.warmup,
                                model=list(profile.train_model))


def run_training(profile: Profile, base: str, progress: Progress) -> dict:
    """Every-iteration, frequency and data-parallel scenarios; runs shared between them are made once."""
    runs: dict[tuple[str, int, int], dict] = {}

    def get(label: str, mode: str, nproc: int, interval: int) -> dict:
        key = (mode, nproc, 0 if mode == "baseline" else interval)
        if key not in runs:
            runs[key] = _train(profile, base, progress, label, mode, nproc, interval)
        return runs[key]

    every = {mode: get("every iteration", mode, 2, 1) for mode in train_bench.MODES}
    frequency = [{**get("frequency", mode, 2, k), "interval": k}
                 for k in profile.intervals for mode in ("datastates", "megatron_async")]
    dp = []
    for n in profile.dp:
        ds = get("data parallel", "datastates", n, 1)
        for mode in ("datastates", "megatron_async"):
            r = get("data parallel", mode, n, 1)
            dp.append({**r, "ckpt_bytes_total": ds["ckpt_bytes_total"]})
    return {"every_iteration": every, "frequency": frequency, "baseline_end_to_end_s": every["baseline"]["end_to_end_s"],
            "data_parallel": dp}


def training_steps(profile: Profile) -> int:
    """How many trainer runs ``run_training`` makes (for the progress count)."""
    keys = {(m, 2, 1) for m in ("datastates", "megatron_async")} | {("baseline", 2, 0)}
    keys |= {(m, 2, k) for k in profile.intervals for m in ("datastates", "megatron_async")}
    keys |= {(m, n, 1) for n in profile.dp for m in ("datastates", "megatron_async")}
    return len(keys)


def gpu_model_inputs(sizes: list[dict], limits: dict, training: dict | None = None) -> dict:
    """The GPU model fed by this run: engine blocked times over sizes, the flush efficiency of the
    largest size (closest to a rank's shard), and the trainer's blocked time per checkpointed byte."""
    ds = sorted((r for r in sizes if r["approach"] == "datastates"), key=lambda r: r["size_bytes"])
    efficiency = ds[-1]["flush_gbps"] / limits["direct_write_gbps"]
    per_byte = None
    if training is not None:
        r = training["every_iteration"]["datastates"]
        per_byte = r["blocked_s"] / r["ckpt_bytes_per_rank"]
    return gpu_model.model_from_measurements([r["size_bytes"] for r in ds], [r["blocked_s"] for r in ds],
                                             min(efficiency, 1.0), per_byte)


def run(profile: Profile, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    base = fresh_dir(os.path.join(out, "work"))
    steps = 2 + len(profile.sizes_mb) * len(SIZE_APPROACHES) + training_steps(profile) + 1
    progress = Progress(steps)
    started = time.time()
    results: dict = {"meta": {"profile": asdict(profile), "started": _iso(started), "host": platform.node(),
                              "cpus": os.cpu_count(), "python": platform.python_version(), "note": NOISE_NOTE}}

    def scenario(name: str, fn: Callable[[], object]) -> None:
        results[name] = fn()
        results["meta"]["duration_s"] = time.time() - started
        write_outputs(results, out)

    largest = max(profile.sizes_mb) << 20
    progress.step("physical limits (before)")
    before = measure_limits(os.path.join(base, "direct"), largest)
    scenario("sizes", lambda: run_sizes(profile.sizes_mb, os.path.join(base, "sizes"), progress))
    progress.step("physical limits (after)")
    after = measure_limits(os.path.join(base, "direct"), largest)
    scenario("limits", lambda: {"before": before, "after": after,
                                **{k: (before[k] + after[k]) / 2 for k in before}})
    scenario("training", lambda: run_training(profile, os.path.join(base, "train"), progress))
    scenario("gpu_model", lambda: gpu_model_inputs(results["sizes"], results["limits"], results["training"]))
    # The every-iteration datastates run's own telemetry, as `telemetry report` shows it to users.
    telemetry_report.report(os.path.join(train_bench.save_dir(os.path.join(base, "train"), "datastates", 2, 1),
                                         "datastates_telemetry"), os.path.join(out, "telemetry"))
    progress.step(f"DeepSpeed: default engine vs datastates, {profile.ds_steps} steps")
    scenario("deepspeed", lambda: deepspeed_bench.run(profile.ds_steps, profile.ds_hidden,
                                                      min(profile.warmup, profile.ds_steps - 1),
                                                      os.path.join(base, "deepspeed")))
    results["meta"]["finished"] = _iso(time.time())
    write_outputs(results, out)
    shutil.rmtree(base)
    return results


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# ---------------------------------------------------------------- outputs


def write_outputs(results: dict, out: str) -> list[str]:
    """``results.json``, ``results.md`` and a PNG per scenario present in ``results``; returns the file names."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    files = ["results.json", "results.md"]
    if "sizes" in results:
        files += _plot_sizes(results["sizes"], results.get("limits"), out)
    if "training" in results:
        files += [_plot_frequency(results["training"], out), _plot_dp(results["training"], out)]
    if "training" in results or "deepspeed" in results:
        files.append(_plot_iterations(results.get("training"), results.get("deepspeed"), out))
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(format_markdown(results))
    return files


def _by_size(sizes: list[dict]) -> tuple[list[int], dict[str, list[dict | None]]]:
    mbs = sorted({r["size_mb"] for r in sizes})
    table = {a: [next((r for r in sizes if r["approach"] == a and r["size_mb"] == mb), None) for mb in mbs]
             for a in SIZE_APPROACHES if any(r["approach"] == a for r in sizes)}
    return mbs, table


def limit_seconds(size_bytes: int, limits: dict | None) -> dict:
    """The physical limits for ``size_bytes``: a memcpy of them and an O_DIRECT write of them, in seconds."""
    if not limits:
        return {"memcpy_s": None, "direct_write_s": None}
    return {"memcpy_s": size_bytes / (limits["memcpy_gbps"] * 1e9),
            "direct_write_s": size_bytes / (limits["direct_write_gbps"] * 1e9)}


MEMCPY_LIMIT, WRITE_LIMIT = "memcpy of the state (limit)", "O_DIRECT write of the state (limit)"


def _plot_sizes(sizes: list[dict], limits: dict | None, out: str) -> list[str]:
    """Two figures in seconds, each with its physical limit drawn beside the approaches."""
    mbs, table = _by_size(sizes)
    nbytes = [next(r["size_bytes"] for r in sizes if r["size_mb"] == mb) for mb in mbs]
    groups = [f"{mb} MB" for mb in mbs]
    blocked = {a: [r["blocked_s"] if r else None for r in rows] for a, rows in table.items()}
    durable = {a: [r["done_s"] if r else None for r in rows] for a, rows in table.items()}
    if limits:
        blocked[MEMCPY_LIMIT] = [limit_seconds(n, limits)["memcpy_s"] for n in nbytes]
        durable[WRITE_LIMIT] = [limit_seconds(n, limits)["direct_write_s"] for n in nbytes]
    plots.grouped_bars(os.path.join(out, "blocked_by_size.png"),
                       "seconds training is blocked per checkpoint (one process, CPU; lower is better)",
                       groups, blocked, "seconds blocked (log)", "state size", log=True)
    plots.grouped_bars(os.path.join(out, "durable_by_size.png"),
                       "seconds from the save until the checkpoint is durable (one process, CPU)",
                       groups, durable, "seconds until durable (log)", "state size", log=True)
    return ["blocked_by_size.png", "durable_by_size.png"]


_TRAIN_NAMES = {"baseline": "no checkpoints", "datastates": "datastates", "megatron_async": "megatron-core async"}


def _plot_frequency(training: dict, out: str) -> str:
    intervals = sorted({r["interval"] for r in training["frequency"]}, reverse=True)
    series = {"no checkpoints": [training["baseline_end_to_end_s"]] * len(intervals)}
    for mode in ("datastates", "megatron_async"):
        series[_TRAIN_NAMES[mode]] = [next(r["end_to_end_s"] for r in training["frequency"]
                                           if r["mode"] == mode and r["interval"] == k) for k in intervals]
    plots.lines(os.path.join(out, "frequency.png"), "end-to-end training time vs checkpoint frequency "
                "(reference trainer, DP 2)", list(range(len(intervals))), series, "checkpoint every N iterations",
                "seconds until the last checkpoint is committed", [str(k) for k in intervals])
    return "frequency.png"


def _plot_dp(training: dict, out: str) -> str:
    dps = sorted({r["nproc"] for r in training["data_parallel"]})
    series = {_TRAIN_NAMES[mode]: [next(r["blocked_s"] for r in training["data_parallel"]
                                        if r["mode"] == mode and r["nproc"] == n) for n in dps]
              for mode in ("datastates", "megatron_async")}
    plots.grouped_bars(os.path.join(out, "data_parallel.png"), "seconds training is blocked per iteration vs "
                       "data-parallel degree (checkpoint every iteration, slowest rank)", [f"DP {n}" for n in dps],
                       series, "seconds blocked (log)", log=True)
    return "data_parallel.png"


def _plot_iterations(training: dict | None, deepspeed: dict | None, out: str) -> str:
    groups, series = [], {n: [] for n in ("no checkpoints", "datastates", "megatron-core async", "DeepSpeed default")}
    if training:
        groups.append("megatron-core GPT (DP 2)")
        every = training["every_iteration"]
        for mode, name in _TRAIN_NAMES.items():
            series[name].append(every[mode]["iter_s"])
        series["DeepSpeed default"].append(None)
    if deepspeed:
        groups.append("DeepSpeed ZeRO-1 (2 ranks)")
        series["no checkpoints"].append(deepspeed["baseline_iter_s"])
        series["datastates"].append(deepspeed["datastates_iter_s"])
        series["megatron-core async"].append(None)
        series["DeepSpeed default"].append(deepspeed["torch_engine_iter_s"])
    plots.grouped_bars(os.path.join(out, "iteration_time.png"), "iteration time, checkpoint every iteration "
                       "(median)", groups, {k: v for k, v in series.items() if any(x is not None for x in v)},
                       "seconds")
    return "iteration_time.png"


def format_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Benchmark suite ({meta['profile']['name']})", "",
             f"Started {meta['started']} on {meta['host']} ({meta['cpus']} CPUs), "
             f"{meta.get('duration_s', 0):.0f} s so far{' (finished)' if 'finished' in meta else ''}. {meta['note']}", ""]
    if "limits" in results:
        lim = results["limits"]
        lines += ["## Physical limits (mean of before and after the size sweep)", "",
                  f"memcpy {lim['memcpy_gbps']:.2f} GB/s, O_DIRECT write {lim['direct_write_gbps']:.2f} GB/s "
                  f"(before {lim['before']['direct_write_gbps']:.2f}, after {lim['after']['direct_write_gbps']:.2f})", ""]
    if "sizes" in results:
        mbs, table = _by_size(results["sizes"])
        nbytes = [next(r["size_bytes"] for r in results["sizes"] if r["size_mb"] == mb) for mb in mbs]
        limit = [limit_seconds(n, results.get("limits")) for n in nbytes]
        head = ["| approach | " + " | ".join(f"{mb} MB" for mb in mbs) + " |", "|---|" + "---|" * len(mbs)]
        lines += ["## Seconds training is blocked per checkpoint (one process)", "",
                  "The limit for a snapshot that blocks is a memcpy of the state; the engine copies while "
                  "the caller computes, so it can block for less.", "", *head]
        for approach, rows in table.items():
            lines.append(f"| {approach} | " + " | ".join(f"{r['blocked_s']:.4f}" if r else "—" for r in rows) + " |")
        if results.get("limits"):
            lines.append(f"| *{MEMCPY_LIMIT}* | " + " | ".join(f"{x['memcpy_s']:.4f}" for x in limit) + " |")
        lines += ["", "## Seconds from the save until the checkpoint is durable (one process)", "",
                  "In brackets: bytes made durable per second (size / seconds until durable). The limit is an "
                  "O_DIRECT write of the same bytes.", "", *head]
        for approach, rows in table.items():
            lines.append(f"| {approach} | " + " | ".join(
                f"{r['done_s']:.3f} ({r['durable_gbps']:.2f} GB/s)" if r else "—" for r in rows) + " |")
        if results.get("limits"):
            lines.append(f"| *{WRITE_LIMIT}* | " + " | ".join(f"{x['direct_write_s']:.3f}" for x in limit) + " |")
        ds = table.get("datastates", [])
        lines += ["", "Time blocked, peer / datastates (same size, same run):", ""]
        for approach, rows in table.items():
            if approach != "datastates":
                ratios = [f"{mb} MB {r['blocked_s'] / d['blocked_s']:.0f}x" for mb, r, d in zip(mbs, rows, ds) if r and d]
                lines.append(f"- {approach}: " + ", ".join(ratios))
        lines.append("")
    if "training" in results:
        tr = results["training"]
        every = tr["every_iteration"]
        base_iter = every["baseline"]["iter_s"]
        lines += ["## Reference trainer, checkpoint every iteration (DP 2)", "",
                  "| mode | iteration s (median) | vs no checkpoints | blocked s per iteration | end-to-end s |",
                  "|---|---|---|---|---|"]
        for mode, name in _TRAIN_NAMES.items():
            r = every[mode]
            lines.append(f"| {name} | {r['iter_s']:.3f} | {r['iter_s'] / base_iter:.2f}x | {r['blocked_s']:.4f} | "
                         f"{r['end_to_end_s']:.1f} |")
        lines += ["", "## Checkpoint frequency (DP 2): end-to-end seconds until the last checkpoint is committed", "",
                  f"No checkpoints: {tr['baseline_end_to_end_s']:.1f} s.", "",
                  "| every N iterations | datastates | megatron-core async | megatron / datastates |", "|---|---|---|---|"]
        for k in sorted({r["interval"] for r in tr["frequency"]}, reverse=True):
            d = next(r for r in tr["frequency"] if r["interval"] == k and r["mode"] == "datastates")
            m = next(r for r in tr["frequency"] if r["interval"] == k and r["mode"] == "megatron_async")
            lines.append(f"| {k} | {d['end_to_end_s']:.1f} | {m['end_to_end_s']:.1f} | "
                         f"{m['end_to_end_s'] / d['end_to_end_s']:.2f}x |")
        lines += ["", "## Data-parallel degree (every iteration): seconds blocked per iteration", "",
                  "| DP | checkpoint MB (all ranks) | datastates | megatron-core async | megatron / datastates |",
                  "|---|---|---|---|---|"]
        for n in sorted({r["nproc"] for r in tr["data_parallel"]}):
            d = next(r for r in tr["data_parallel"] if r["nproc"] == n and r["mode"] == "datastates")
            m = next(r for r in tr["data_parallel"] if r["nproc"] == n and r["mode"] == "megatron_async")
            lines.append(f"| {n} | {d['ckpt_bytes_total'] / 1e6:.0f} | {d['blocked_s']:.4f} | {m['blocked_s']:.4f} | "
                         f"{m['blocked_s'] / max(d['blocked_s'], 1e-9):.0f}x |")
        lines.append("")
    if "deepspeed" in results:
        lines += ["## DeepSpeed (ZeRO-1, 2 ranks, checkpoint every step)", "", deepspeed_bench.format_table(results["deepspeed"]), ""]
    if "gpu_model" in results:
        lines += ["## Model of the GPU case (megatron_ext/bench/gpu_model.py)", "", gpu_model.format_model(results["gpu_model"]), ""]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench suite``."""
    p.add_argument("--out", default="runs/bench-suite", help="output directory (default runs/bench-suite)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer iterations (a few minutes)")
    p.add_argument("--json", action="store_true", help="print results.json's object instead of the Markdown")


def main(args) -> int:
    profile = QUICK if args.quick else FULL
    results = run(profile, args.out)
    if args.json:
        print(json.dumps(results, indent=1, default=str))
        return 0
    print(format_markdown(results))
    print(f"\nwrote {args.out}/results.json, results.md and the plots in {results['meta']['duration_s']:.0f} s")
    return 0
