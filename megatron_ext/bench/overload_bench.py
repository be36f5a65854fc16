"""``megatron-ext bench overload``: checkpointing every iteration onto storage too slow to keep up.

One process runs the same training-like loop (compute, ``wait_snapshot``, in-place optimizer
step, save + commit) without checkpoints (the baseline, first and last since the machine's speed
drifts) and with a checkpoint every iteration through a throttled writer (a fault hook that limits
the write rate so one checkpoint's flush takes ``flush_factor`` iterations): with
``overload_policy="wait"``, with "supersede", and twice through a host cache smaller than one
checkpoint: "supersede" alone and with ``max_durable_age``. It reports the mean iteration time and
the largest age, in iterations, of the newest committed checkpoint seen at the end of any iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from megatron_ext.arg_types import NONNEG, POSITIVE, POSITIVE_INT
from megatron_ext.bench.common import busy_compute, fresh_dir, make_state, state_bytes, working_dir
from megatron_ext.engine import CheckpointEngine, faults

NAME = "overload"
HELP = "a checkpoint every iteration on a throttled writer: wait vs supersede"


def _progress(msg: str) -> None:
    print(f"[bench overload] {msg}", file=sys.stderr, flush=True)


#: name -> (host cache as a multiple of the checkpoint, policy, with the durable-age bound)
RUNS = {"wait": (2.0, "wait", False), "supersede": (2.0, "supersede", False),
        "supersede_small_cache": (0.5, "supersede", False), "supersede_small_cache_bounded": (0.5, "supersede", True)}


def _loop(state: dict[str, torch.Tensor], iters: int, compute_s: float, engine: CheckpointEngine | None) -> dict:
    """The training loop; returns the mean iteration time and the worst durable age."""
    ages = []
    start = time.perf_counter()
    for i in range(1, iters + 1):
        busy_compute(compute_s)  # forward and backward
        if engine is not None:
            engine.wait_snapshot()  # the optimizer step may now change the tensors
        for t in state.values():
            t.add_(1)
        if engine is not None:
            engine.save(state, f"it_{i:05d}", version=i)
            engine.commit(f"it_{i:05d}")
            newest = engine.newest_durable_version
            ages.append(i - (newest or 0))
    elapsed = time.perf_counter() - start
    return {"iter_s": elapsed / iters, "max_durable_age_iters": max(ages) if ages else None}


def _checkpointed(state, iters: int, compute_s: float, directory: str, cache_bytes: int, policy: str,
                  max_age: int | None) -> dict:
    engine = CheckpointEngine({"save_dir": directory, "host_cache_size": cache_bytes / 2**30, "chunk_size_mb": 1,
                               "overload_policy": policy, "max_durable_age": max_age}, rank=0, world_size=1)
    engine.cache.wait_allocated(600)  # a trainer allocates once, long before its first save
    result = _loop(state, iters, compute_s, engine)
    engine.shutdown()
    records = list(engine.telemetry.records)
    result["committed"] = sum(1 for r in records if r["event"] == "commit")
    result["skipped"] = sum(1 for r in records if r["event"] == "skipped")
    result["backpressure_waits"] = engine.backpressure_waits
    result["backpressure_wait_s"] = engine.backpressure_wait_s
    return result


def run(size_mb: float = 64, iters: int = 20, compute_s: float = 0.2, flush_factor: float = 3.0,
        directory: str | None = None) -> dict:
    with working_dir(directory, "megatron-ext-bench-") as base:
        state = make_state(int(size_mb * 1e6), tensor_bytes=4 << 20)
        nbytes = state_bytes(state)
        rate = nbytes / (flush_factor * compute_s)
        result: dict = {"state_bytes": nbytes, "iters": iters, "compute_s": compute_s, "flush_factor": flush_factor,
                        "throttle_mbps": rate / 1e6}
        _progress(f"baseline: {iters} iterations of {compute_s}s compute, no checkpoints")
        baseline = [_loop(state, iters, compute_s, None)["iter_s"]]
        max_age = int(2 * flush_factor)
        result["max_durable_age_bound"] = max_age
        faults.arm(faults.throttle(rate, base))
        try:
            for key, (cache_factor, policy, bound) in RUNS.items():
                cache_bytes = int(cache_factor * nbytes) + (8 << 20)
                _progress(f"{key}: a checkpoint every iteration, writer throttled to {rate / 1e6:.0f} MB/s, "
                          f"host cache {cache_factor} x the checkpoint"
                          + (f", max_durable_age {max_age}" if bound else ""))
                out = _checkpointed(state, iters, compute_s, fresh_dir(os.path.join(base, key)), cache_bytes, policy,
                                    max_age if bound else None)
                result["host_cache_bytes_" + key] = cache_bytes
                for name, value in out.items():
                    result[f"{name}_{key}"] = value
        finally:
            faults.disarm_all()
        _progress("baseline again")
        baseline.append(_loop(state, iters, compute_s, None)["iter_s"])
        result["iter_s_baseline"] = sum(baseline) / len(baseline)
        result["iter_s_baseline_first_last"] = baseline
        result["ratio_wait_vs_baseline"] = result["iter_s_wait"] / result["iter_s_baseline"]
        result["ratio_supersede_vs_baseline"] = result["iter_s_supersede"] / result["iter_s_baseline"]
        return result


def format_table(r: dict) -> str:
    lines = [f"checkpoint {r['state_bytes'] / 1e6:.0f} MB every iteration, compute {r['compute_s']}s, writer "
             f"throttled to {r['throttle_mbps']:.0f} MB/s (one flush = {r['flush_factor']} iterations)",
             f"  {'baseline (no checkpoints)':<30} {r['iter_s_baseline']:.3f} s/iter",
             f"  (bounded: max_durable_age {r['max_durable_age_bound']})"]
    for key in RUNS:
        lines.append(f"  {key:<30} {r['iter_s_' + key]:.3f} s/iter, newest durable at most "
                     f"{r['max_durable_age_iters_' + key]} iterations old, {r['committed_' + key]} committed, "
                     f"{r['skipped_' + key]} skipped, {r['backpressure_waits_' + key]} waits for the flush")
    lines.append(f"  {'ratios vs baseline':<30} wait {r['ratio_wait_vs_baseline']:.2f}, "
                 f"supersede {r['ratio_supersede_vs_baseline']:.2f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench overload``."""
    p.add_argument("--size-mb", type=POSITIVE, default=64, help="checkpoint size in MB (default 64)")
    p.add_argument("--iters", type=POSITIVE_INT, default=20)
    p.add_argument("--compute-s", type=NONNEG, default=0.2, help="compute per iteration in seconds (default 0.2)")
    p.add_argument("--flush-factor", type=POSITIVE, default=3.0,
                   help="the throttle makes one checkpoint's flush take this many iterations (default 3)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.size_mb, args.iters, args.compute_s, args.flush_factor, args.dir)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
