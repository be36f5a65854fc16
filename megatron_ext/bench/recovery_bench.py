"""``megatron-ext bench recovery``: a training job SIGKILLed and restarted, datastates vs megatron-core torch_dist.

The reference trainer (megatron-core GPT, ``train_bench.MODEL``) on 2 CPU ranks (DP 2), one run of
each step in one invocation:

1. **What each costs per iteration** (same run): the trainer without checkpoints, with
   ``--use-datastates --save-interval 1`` and with megatron-core's asynchronous ``torch_dist`` save
   every iteration (``--megatron-async-save``, as Megatron-LM's ``--async-save``). Overhead = mean
   iteration time minus the baseline's. Datastates' overhead per iteration is its cost at interval 1;
   torch_dist's overhead at interval 1 is its cost per save, so at interval ``I`` it costs about
   ``cost / I`` per iteration. The *equal-overhead interval* is ``I = round(cost_torch_dist /
   overhead_datastates)`` (at least 1, at most ``max_interval``): checkpointing every ``I``
   iterations costs torch_dist what checkpointing every iteration costs datastates.
2. **Crash and recovery**, ``repeats`` times each way (alternating which goes first): datastates
   at interval 1, torch_dist at interval ``I``. The job trains until iteration ``K`` is logged;
   then every process of the job (torchrun and both ranks) gets SIGKILL, as when a node dies,
   mid-way through iteration ``K + 1``. ``K`` lies half an interval after a torch_dist save, and
   after at least two saves (``I·max(2, ceil(4/I)) + I//2``): the average case for a failure at a
   random time (the worst case loses ``I - 1`` more iterations), with the newest checkpoint a
   steady-state one (a process's first async save also starts megatron-core's writer, seconds
   more). The same command then restarts with ``--load``; **recovery** = from the kill to the end
   of the first new iteration, split into restart (new processes, imports, model and optimizer
   built: up to the load call), load, and the first iteration; **iterations lost** = last
   iteration finished before the kill minus the iteration the restarted job resumed from. Medians
   over repetitions; every repetition is reported. As a check, the overhead torch_dist actually
   had at interval ``I`` (its iterations after its first save, before the kill, against the
   baseline) is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time

from megatron_ext.arg_types import POSITIVE_INT
from megatron_ext.bench import train_bench
from megatron_ext.bench.common import working_dir
from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE
from megatron_ext.procs import kill_tree, start_logged, torchrun_command

NAME = "recovery"
HELP = ("SIGKILL a training job and restart it: recovery time and iterations lost, "
        "datastates vs megatron-core torch_dist")

WAYS = {"datastates": "datastates", "torch_dist": "megatron_async"}  # our name -> train_bench mode
RUN_TIMEOUT_S = 1200


def _progress(msg: str) -> None:
    print(f"[bench recovery] {msg}", file=sys.stderr, flush=True)


def equal_overhead_interval(cost_per_save_s: float, overhead_per_iter_s: float, max_interval: int = 50) -> int:
    """The interval at which saves costing ``cost_per_save_s`` each cost ``overhead_per_iter_s`` per iteration."""
    if overhead_per_iter_s <= 0:  # datastates' cost is below the noise: torch_dist can only match it rarely
        return max_interval
    return max(1, min(max_interval, round(cost_per_save_s / overhead_per_iter_s)))


def kill_point(interval: int, first: int = 4) -> int:
    """The iteration after which the job is killed: half an interval after a save, after two saves at
    least and not before ``first``."""
    return interval * max(2, math.ceil(first / interval)) + interval // 2


def read_records(path: str) -> list[dict]:
    """The complete JSON lines of a trainer's ``--log-json`` (a line being written is skipped)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _wait_for(predicate, proc, what: str, log_path: str, timeout_s: float) -> None:
    """Poll every 10 ms until ``predicate()``; fail if the job exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited ({proc.returncode}) before {what}; see {log_path}")
        if time.monotonic() > deadline:
            kill_tree(proc)
            raise RuntimeError(f"no {what} within {timeout_s:.0f}s; see {log_path}")
        time.sleep(0.01)


def _tracker(save: str) -> int | None:
    try:
        with open(os.path.join(save, TRACKER_FILE)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def crash_and_recover(way: str, interval: int, kill_after: int, base: str, nproc: int = 2,
                      model: list[str] = train_bench.MODEL, host_cache_gb: float = 0.5,
                      timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """Train with checkpoints every ``interval``, SIGKILL the job after iteration ``kill_after``, restart it."""
    save = os.path.join(base, f"recovery-{way}-every{interval}")
    shutil.rmtree(save, ignore_errors=True)
    flags = {"datastates": ["--use-datastates", "--datastates-host-cache-size", str(host_cache_gb)],
             "torch_dist": ["--megatron-async-save"]}[way]
    args = [*model, *flags, "--save", save, "--save-interval", str(interval), "--train-iters", str(kill_after + 1000)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before, after = f"{save}-before.jsonl", f"{save}-after.jsonl"
    for path in (before, after):
        if os.path.exists(path):
            os.unlink(path)

    def launch(extra: list[str], log_json: str):
        cmd = torchrun_command(nproc, "-m", "megatron_ext.testing.reference_trainer", *args, *extra,
                               "--log-json", log_json)
        return start_logged(cmd, env, log_json.replace(".jsonl", ".log"))

    proc = launch([], before)
    try:
        _wait_for(lambda: any(r["iteration"] >= kill_after for r in read_records(before)), proc,
                  f"iteration {kill_after}", before.replace(".jsonl", ".log"), timeout_s)
    finally:
        killed_at = time.time()
        kill_tree(proc)
    records = read_records(before)
    finished = records[-1]["iteration"]
    committed = _tracker(save)

    proc = launch(["--load", save], after)
    try:
        _wait_for(lambda: bool(read_records(after)), proc, "first iteration after the restart",
                  after.replace(".jsonl", ".log"), timeout_s)
    finally:
        kill_tree(proc)
    first = read_records(after)[0]
    resumed_from = first["iteration"] - 1
    steady = [r["iter_time_s"] for r in records if r["iteration"] > max(interval, 3)]  # after the first save
    return {
        "way": way, "interval": interval, "kill_after": kill_after,
        "finished_before_kill": finished, "committed_at_kill": committed, "resumed_from": resumed_from,
        "lost_iters": finished - resumed_from,
        "recovery_s": first["wall_time"] - killed_at,
        "restart_s": first["load_started_at"] - killed_at,
        "load_s": first["load_s"], "first_iter_s": first["iter_time_s"],
        "iter_s_mean_after_first_save": statistics.mean(steady) if steady else None,
    }


def run(iters: int = 12, nproc: int = 2, warmup: int = 3, workdir: str | None = None,
        model: list[str] = train_bench.MODEL, max_interval: int = 50, interval: int | None = None,
        host_cache_gb: float = 0.5, repeats: int = 3) -> dict:
    """Both steps of the module docstring; ``interval`` skips step 1 and uses that torch_dist interval."""
    with working_dir(workdir, "megatron-ext-bench-recovery-") as base:
        result: dict = {"nproc": nproc, "repeats": repeats, "load_avg_start": os.getloadavg()[0]}
        steps = 2 * repeats + (3 if interval is None else 0)
        if interval is None:
            runs = {}
            for i, mode in enumerate(train_bench.MODES, 1):
                _progress(f"{i}/{steps} overhead: {mode}, {iters} iterations, a checkpoint every iteration")
                runs[mode] = train_bench.run_mode(mode, base, iters, nproc, 1, warmup, host_cache_gb, model)
            baseline = runs["baseline"]["iter_s_mean"]
            result["baseline_iter_s"] = baseline
            result["overhead_s_per_iter_datastates"] = runs["datastates"]["iter_s_mean"] - baseline
            result["cost_s_per_save_torch_dist"] = runs["megatron_async"]["iter_s_mean"] - baseline
            interval = equal_overhead_interval(result["cost_s_per_save_torch_dist"],
                                               result["overhead_s_per_iter_datastates"], max_interval)
        result["torch_dist_interval"] = interval
        kill_after = kill_point(interval)
        result["kill_after_iteration"] = kill_after
        ways = (("datastates", 1), ("torch_dist", interval))
        got: dict[str, list[dict]] = {way: [] for way, _ in ways}
        step = steps - 2 * repeats
        for rep in range(repeats):
            for way, every in (ways if rep % 2 == 0 else ways[::-1]):
                step += 1
                _progress(f"{step}/{steps} {way} every {every}: SIGKILL after iteration {kill_after}, "
                          "restart with --load")
                got[way].append(crash_and_recover(way, every, kill_after, base, nproc, model, host_cache_gb))
        for way, runs_ in got.items():
            result[f"runs_{way}"] = runs_
            for key in ("recovery_s", "restart_s", "load_s", "first_iter_s", "lost_iters"):
                result[f"{key}_{way}"] = statistics.median(r[key] for r in runs_)
        if "baseline_iter_s" in result:
            steady = [r["iter_s_mean_after_first_save"] for r in got["torch_dist"] if r["iter_s_mean_after_first_save"]]
            result["overhead_s_per_iter_torch_dist_at_interval"] = (
                statistics.median(steady) - result["baseline_iter_s"] if steady else None)
        result["recovery_ratio_torch_dist_vs_datastates"] = (result["recovery_s_torch_dist"]
                                                             / result["recovery_s_datastates"])
        result["load_avg_end"] = os.getloadavg()[0]
        return result


def format_table(r: dict) -> str:
    lines = [f"{r['nproc']} CPU ranks (DP {r['nproc']}), medians of {r['repeats']}; load average"
             f" {r['load_avg_start']:.1f} -> {r['load_avg_end']:.1f}"]
    if "baseline_iter_s" in r:
        lines.append(f"  overhead            datastates every iteration {r['overhead_s_per_iter_datastates'] * 1000:.0f}"
                     f" ms/iter; torch_dist {r['cost_s_per_save_torch_dist'] * 1000:.0f} ms per save"
                     f" (baseline iteration {r['baseline_iter_s'] * 1000:.0f} ms)")
    check = r.get("overhead_s_per_iter_torch_dist_at_interval")
    lines.append(f"  equal overhead      torch_dist every {r['torch_dist_interval']} iterations"
                 + (f" (measured there: {check * 1000:.0f} ms/iter)" if check is not None else ""))
    for way in ("datastates", "torch_dist"):
        lines.append(f"  {way:<19} killed after iteration {r['kill_after_iteration']}: {r[f'lost_iters_{way}']}"
                     f" iterations lost; recovery {r[f'recovery_s_{way}']:.1f}s = restart {r[f'restart_s_{way}']:.1f}s"
                     f" + load {r[f'load_s_{way}']:.2f}s + first iteration {r[f'first_iter_s_{way}']:.2f}s (and the rest)")
    lines.append(f"  ratio               torch_dist / datastates recovery {r['recovery_ratio_torch_dist_vs_datastates']:.2f}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench recovery``."""
    p.add_argument("--iters", type=POSITIVE_INT, default=12, help="iterations of each overhead run (default 12)")
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks (data parallel, default 2)")
    p.add_argument("--interval", type=POSITIVE_INT, default=None,
                   help="torch_dist's checkpoint interval (default: measured, the one of equal overhead)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="kills and restarts of each way (default 3)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.iters, args.nproc, workdir=args.dir, interval=args.interval, repeats=args.repeats)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
