"""``megatron-ext bench replica``: what peer replicas in host memory cost, measured in one run.

The reference trainer with ``--use-datastates --save-interval 1`` twice on the same model and
ranks, simulated as nodes of ``ranks_per_node`` ranks: without and with
``--datastates-peer-replica``. Reported: median iteration time and mean time blocked per
iteration (the slowest rank's), their ratios, and the bytes each rank replicates per checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import uuid

from megatron_ext.arg_types import POSITIVE_INT
from megatron_ext.bench.common import run_reference_trainer, working_dir
from megatron_ext.bench.train_bench import MODEL
from megatron_ext.megatron.checkpoint_layout import checkpoint_dir

NAME = "replica"
HELP = "reference trainer with datastates, peer replicas in host memory off vs on"


def _progress(msg: str) -> None:
    print(f"[bench replica] {msg}", file=sys.stderr, flush=True)


def run(iters: int = 10, nproc: int = 4, ranks_per_node: int = 2, warmup: int = 3, workdir: str | None = None,
        host_cache_gb: float = 0.5) -> dict:
    with working_dir(workdir, "megatron-ext-bench-replica-") as base:
        replica_dir = os.path.join("/dev/shm", f"megatron_ext-bench-{uuid.uuid4().hex[:8]}")
        common = ["--train-iters", str(iters), "--save-interval", "1", "--use-datastates",
                  "--datastates-host-cache-size", str(host_cache_gb)]
        modes = {
            "replica_off": ["--save", f"{base}/off"],
            "replica_on": ["--save", f"{base}/on", "--datastates-peer-replica", "--datastates-ranks-per-node",
                           str(ranks_per_node), "--datastates-replica-dir", replica_dir],
        }
        records = {}
        try:
            for i, (mode, extra) in enumerate(modes.items(), 1):
                _progress(f"{i}/2 {mode}: {iters} iterations on {nproc} CPU ranks, {ranks_per_node} per node")
                records[mode] = run_reference_trainer(nproc, [*MODEL, *common, *extra], f"{base}/{mode}.jsonl")[warmup:]
        finally:
            shutil.rmtree(replica_dir, ignore_errors=True)

        def iter_s(mode: str) -> float:
            return statistics.median(r["iter_time_s"] for r in records[mode])

        def blocked_s(mode: str) -> float:
            return statistics.mean(r["ckpt_blocked_s"] for r in records[mode])

        with open(os.path.join(checkpoint_dir(os.path.join(base, "on"), iters), "manifest.json")) as f:
            files = json.load(f)["files"].values()
        result = {
            "nproc": nproc, "ranks_per_node": ranks_per_node, "iterations_measured": iters - warmup,
            "iter_s_replica_off": iter_s("replica_off"), "iter_s_replica_on": iter_s("replica_on"),
            "blocked_s_replica_off": blocked_s("replica_off"), "blocked_s_replica_on": blocked_s("replica_on"),
            "replicated_bytes_per_rank": sum(f["size"] + f["state_size"] for f in files) / len(files),
        }
        result["ratio_iter_on_vs_off"] = result["iter_s_replica_on"] / result["iter_s_replica_off"]
        result["ratio_blocked_on_vs_off"] = result["blocked_s_replica_on"] / max(result["blocked_s_replica_off"], 1e-9)
        return result


def format_table(r: dict) -> str:
    return "\n".join([
        f"{r['nproc']} CPU ranks ({r['ranks_per_node']} per simulated node), checkpoint every iteration, "
        f"{r['replicated_bytes_per_rank'] / 1e6:.1f} MB per rank, median of {r['iterations_measured']} iterations",
        f"  datastates               iteration {r['iter_s_replica_off'] * 1000:.1f} ms, blocked "
        f"{r['blocked_s_replica_off'] * 1000:.1f} ms",
        f"  datastates + peer copy   iteration {r['iter_s_replica_on'] * 1000:.1f} ms, blocked "
        f"{r['blocked_s_replica_on'] * 1000:.1f} ms",
        f"  ratios on/off            iteration {r['ratio_iter_on_vs_off']:.3f}, "
        f"blocked {r['ratio_blocked_on_vs_off']:.2f}",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench replica``."""
    p.add_argument("--iters", type=POSITIVE_INT, default=10)
    p.add_argument("--nproc", type=POSITIVE_INT, default=4, help="CPU ranks (data parallel)")
    p.add_argument("--ranks-per-node", type=POSITIVE_INT, default=2, help="ranks per simulated node (default 2)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one here)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    result = run(args.iters, args.nproc, args.ranks_per_node, workdir=args.dir)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
