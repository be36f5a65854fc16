"""``megatron-ext bench restore``: this engine's restore against the best read of the same file, torch.load and DCP.

The same in-memory state of G GB is saved once by each (this engine, ``torch.save``,
``torch.distributed.checkpoint.save``), then read back in one process. Before every timed read
the files' pages are dropped from the page cache, so each figure is a cold read from the disk.
Like DCP's ``load``, the engine's restore fills existing tensors (``load_into``: a trainer restores
into its live model), checksums verified; ``torch.load`` and the engine's ``load`` allocate new ones.

The ceiling (``read_ceiling_gbps``) is the best plain read of the engine's file this machine does in
this run, whatever the method: sequential 16 MiB ``O_DIRECT`` reads by one thread and by
``restore_threads`` threads, and cold buffered reads with the kernel's read-ahead
(``POSIX_FADV_SEQUENTIAL``) by one stream and by ``restore_threads`` streams. The disk of a shared
VM drifts 2x from one minute to the next, so the reads and the engine's restore are repeated in
``repeats`` rounds (default 3), each round in a rotated order, each ratio taken within a round; the
figures are medians over rounds, every round is reported (``rounds``) and each headline figure
``X`` has its rounds' values under ``X_by_round`` and their max - min under ``X_spread``. The
peers' loads (``torch.load``, DCP's ``load``) run in the same rounds.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch

from megatron_ext.arg_types import POSITIVE, POSITIVE_INT
from megatron_ext.bench.common import (DEFAULT_REPEATS, drop_page_cache, ensure_process_group, figure_over_rounds,
                                       fresh_dir, make_state, read_seconds, state_bytes, working_dir)
from megatron_ext.engine import CheckpointEngine
from megatron_ext.engine.read import staged_read

NAME = "restore"
HELP = "engine restore vs torch.load, DCP load and an O_DIRECT read (cold)"

FILE = "rank00000"  # the one file of a single-rank save


def _progress(msg: str) -> None:
    print(f"[bench restore] {msg}", file=sys.stderr, flush=True)


def buffered_read_gbps(path: str) -> float:
    """One plain buffered sequential read of ``path``, no advice (to show whether the cache was dropped)."""
    buf = bytearray(16 << 20)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return os.path.getsize(path) / (time.perf_counter() - start) / 1e9


def read_gbps(path: str, threads: int = 1, direct: bool = True, chunk_bytes: int = 16 << 20) -> float:
    """A cold read of the whole of ``path`` by ``threads`` threads (``read_seconds``), in GB/s."""
    drop_page_cache(os.path.dirname(path))
    return os.path.getsize(path) / read_seconds(path, threads, direct, chunk_bytes) / 1e9


def _timed(directory: str, load) -> tuple[float, object]:
    drop_page_cache(directory)
    gc.collect()
    start = time.perf_counter()
    result = load()
    return time.perf_counter() - start, result


#: The reads the ceiling is the best of: name -> (threads is restore_threads, O_DIRECT).
CEILING_READS = {"direct_1": (False, True), "direct_threads": (True, True),
                 "buffered_1": (False, False), "buffered_threads": (True, False)}


def _stream(reader, template: dict, staging) -> None:
    staged_read.stream_into(reader.tensor_path, reader.listed, template, staging, threads=reader.threads)


def _fresh_buffer(reader, template: dict, staging) -> None:
    fresh = reader.tensors(list(template))
    for name, target in template.items():
        target.copy_(fresh[name])


#: How GPU targets can be filled, run on host tensors: ``stream_into`` (through reused slots, as
#: ``read_into`` does for GPU tensors) and the design it replaced (a fresh host buffer of the file's
#: tensors, then copies; on a GPU node that buffer must also be pinned, which is not measured here).
GPU_PATHS = {"stream": _stream, "fresh_buffer": _fresh_buffer}


def measure_rounds(engine: CheckpointEngine, checkpoint: str, template: dict, expected: dict, tensor_file: str,
                   threads: int, repeats: int, peers: dict | None = None) -> dict:
    """``repeats`` rounds of the ceiling reads, the engine's ``load_into`` and ``peers`` (name -> a function
    returning the seconds of one cold load), the order rotated each round."""
    peers = peers or {}
    kinds = [*CEILING_READS, "datastates", *GPU_PATHS, *peers]
    nbytes = state_bytes(expected)
    reader = engine.open_checkpoint(checkpoint).reader(FILE)
    staging = staged_read.default_staging(threads)
    staging.wait_allocated(600)
    rounds = []
    for r in range(repeats):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        got: dict = {}
        for kind in order:
            if kind == "datastates":
                for t in template.values():
                    t.zero_()
                seconds, loaded = _timed(os.path.dirname(tensor_file), lambda: engine.load_into(checkpoint, template))
                got["datastates"] = nbytes / seconds / 1e9
                got["datastates_s"] = seconds
                got["bit_exact"] = all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))
                                       for k, v in expected.items())
                del loaded
            elif kind in peers:
                got[f"{kind}_s"] = peers[kind]()
            elif kind in GPU_PATHS:
                for t in template.values():
                    t.zero_()
                seconds, _ = _timed(os.path.dirname(tensor_file), lambda: GPU_PATHS[kind](reader, template, staging))
                got[f"{kind}_s"] = seconds
                got["bit_exact"] = got.get("bit_exact", True) and all(
                    torch.equal(template[k].view(torch.uint8), v.view(torch.uint8)) for k, v in expected.items())
            else:
                many, direct = CEILING_READS[kind]
                got[kind] = read_gbps(tensor_file, threads if many else 1, direct)
        got["ceiling"] = max(got[k] for k in CEILING_READS)
        got["ratio"] = got["datastates"] / got["ceiling"]
        got["stream_vs_fresh"] = got["fresh_buffer_s"] / got["stream_s"]
        got["order"] = order
        _progress(f"round {r + 1}/{repeats}: datastates {got['datastates']:.2f} GB/s, ceiling {got['ceiling']:.2f}"
                  f" GB/s ({', '.join(f'{k} {got[k]:.2f}' for k in CEILING_READS)}), ratio {got['ratio']:.2f}")
        rounds.append(got)
    median = {k: statistics.median(g[k] for g in rounds)
              for k in [*CEILING_READS, "datastates", "datastates_s", "ratio", "stream_s", "fresh_buffer_s",
                        "stream_vs_fresh", *(f"{p}_s" for p in peers)]}
    ceiling = max(median[k] for k in CEILING_READS)
    spread = {}
    for name, per_round in (("datastates_restore_s", [g["datastates_s"] for g in rounds]),
                            ("datastates_restore_gbps", [g["datastates"] for g in rounds]),
                            ("read_ceiling_gbps", [g["ceiling"] for g in rounds]),
                            ("datastates_vs_ceiling_median_of_rounds", [g["ratio"] for g in rounds]),
                            ("gpu_path_stream_vs_fresh_buffer", [g["stream_vs_fresh"] for g in rounds]),
                            *((f"{p}_s", [g[f"{p}_s"] for g in rounds]) for p in peers),
                            *((f"datastates_vs_{p}", [g[f"{p}_s"] / g["datastates_s"] for g in rounds])
                              for p in peers)):
        spread.update({k: v for k, v in figure_over_rounds(name, per_round).items() if k != name})
    return {
        **spread,
        **{f"{p}_s": median[f"{p}_s"] for p in peers},
        "rounds": rounds,
        "datastates_bit_exact": all(g["bit_exact"] for g in rounds),
        "datastates_restore_s": median["datastates_s"],
        "datastates_restore_gbps": median["datastates"],
        "direct_read_gbps": median["direct_1"],
        "direct_read_parallel_gbps": median["direct_threads"],
        "buffered_read_gbps": median["buffered_1"],
        "buffered_read_parallel_gbps": median["buffered_threads"],
        "read_ceiling_gbps": ceiling,
        "read_ceiling_method": max(CEILING_READS, key=lambda k: median[k]),
        "datastates_vs_ceiling": median["datastates"] / ceiling,
        "datastates_vs_ceiling_median_of_rounds": median["ratio"],
        "datastates_vs_direct": median["datastates"] / median["direct_1"],
        "datastates_vs_direct_parallel": median["datastates"] / median["direct_threads"],
        "gpu_path_stream_s": median["stream_s"],
        "gpu_path_fresh_buffer_s": median["fresh_buffer_s"],
        "gpu_path_stream_vs_fresh_buffer": median["stream_vs_fresh"],
        "gpu_path_stream_vs_restore": median["datastates_s"] / median["stream_s"],
    }


def run(size_gb: float, directory: str | None = None, threads: int = 4, repeats: int = DEFAULT_REPEATS,
        megatron: str = "auto") -> dict:
    with working_dir(directory, "megatron-ext-bench-restore-") as base:
        base = os.path.abspath(base)
        _progress(f"building a {size_gb} GB state and saving it three ways")
        state = make_state(int(size_gb * 1e9))
        nbytes = state_bytes(state)
        load_before = list(os.getloadavg())
        result: dict = {"state_bytes": nbytes, "restore_threads": threads, "repeats": repeats,
                        "load_avg_start": os.getloadavg()[0]}

        ds_dir = fresh_dir(os.path.join(base, "datastates"))
        config = {"save_dir": ds_dir, "host_cache_size": max(nbytes / 2**30 * 1.02, 0.01), "restore_threads": threads}
        with CheckpointEngine(config, rank=0, world_size=1) as engine:
            engine.save_and_commit(state, "step1")
            engine.wait_persisted()
        pt_path = os.path.join(fresh_dir(os.path.join(base, "torch_save")), "state.pt")
        with open(pt_path, "wb") as f:
            torch.save(state, f)
        import torch.distributed.checkpoint as dcp

        ensure_process_group(base)
        dcp_dir = fresh_dir(os.path.join(base, "dcp"))
        dcp.save(state, checkpoint_id=dcp_dir)

        engine = CheckpointEngine({**config, "host_cache_size": 0.25, "remove_partial_on_start": False},
                                  rank=0, world_size=1)
        engine.cache.wait_allocated(600)  # a trainer's engine allocates its cache long before a restore
        template = {k: torch.zeros_like(v) for k, v in state.items()}  # the live model's tensors (resident)
        tensor_file = os.path.join(ds_dir, engine.open_checkpoint("step1").manifest["files"][FILE]["tensor_file"])
        _progress("page cache check: cold vs warm buffered read of the engine's file")
        drop_page_cache(ds_dir)
        result["buffered_cold_gbps"] = buffered_read_gbps(tensor_file)
        result["buffered_warm_gbps"] = buffered_read_gbps(tensor_file)

        def torch_load() -> float:
            seconds, loaded = _timed(os.path.dirname(pt_path),
                                     lambda: torch.load(pt_path, map_location="cpu", weights_only=True))
            del loaded
            return seconds

        def dcp_load() -> float:  # into existing tensors, as the engine's load_into
            for t in template.values():
                t.zero_()
            return _timed(dcp_dir, functools.partial(dcp.load, template, checkpoint_id=dcp_dir))[0]

        _progress(f"{repeats} rounds: O_DIRECT and buffered reads of the engine's file, the engine's restore, "
                  "torch.load and DCP load")
        result.update(measure_rounds(engine, "step1", template, state, tensor_file, threads, repeats,
                                     {"torch_load": torch_load, "dcp_load": dcp_load}))
        _progress("datastates load into new tensors")
        seconds, loaded = _timed(ds_dir, lambda: engine.load("step1"))
        result["datastates_load_new_tensors_s"] = seconds
        del loaded
        engine.shutdown()
        del template, state
        gc.collect()

        result["torch_load_gbps"] = nbytes / result["torch_load_s"] / 1e9
        result["dcp_load_gbps"] = nbytes / result["dcp_load_s"] / 1e9
        result["datastates_vs_torch_load"] = result["torch_load_s"] / result["datastates_restore_s"]
        result["datastates_vs_dcp_load"] = result["dcp_load_s"] / result["datastates_restore_s"]
        if megatron != "off":
            from megatron_ext.bench import megatron_load_bench

            _progress("Megatron-LM load_checkpoint: datastates vs torch_dist (2 CPU ranks)")
            got = megatron_load_bench.measure(os.path.join(base, "megatron"), repeats=repeats)
            if megatron == "on" and "megatron_load_skipped" in got:
                raise RuntimeError(got["megatron_load_skipped"])
            result.update(got)
        result["load_avg_end"] = os.getloadavg()[0]
        result["load_average_before"], result["load_average_after"] = load_before, list(os.getloadavg())
        result["workdir"] = base
        return result


def format_table(r: dict) -> str:
    gb = r["state_bytes"] / 1e9
    lines = [
        f"state {gb:.2f} GB, cold reads (page cache dropped before each; buffered cold "
        f"{r['buffered_cold_gbps']:.2f} GB/s vs warm {r['buffered_warm_gbps']:.2f} GB/s);"
        f" load average {r['load_avg_start']:.1f} -> {r['load_avg_end']:.1f}",
        f"  reads of the file   O_DIRECT 1 thread {r['direct_read_gbps']:.2f}, {r['restore_threads']} threads"
        f" {r['direct_read_parallel_gbps']:.2f}; buffered read-ahead 1 stream {r['buffered_read_gbps']:.2f},"
        f" {r['restore_threads']} streams {r['buffered_read_parallel_gbps']:.2f} GB/s (medians of {r['repeats']})",
        f"  ceiling             {r['read_ceiling_gbps']:.2f} GB/s ({r['read_ceiling_method']})",
        f"  datastates restore  {r['datastates_restore_s']:.2f}s = {r['datastates_restore_gbps']:.2f} GB/s"
        f" into existing tensors ({r['restore_threads']} threads, bit-exact: {r['datastates_bit_exact']});"
        f" {r['datastates_load_new_tensors_s']:.2f}s into new tensors",
        "  rounds              " + "; ".join(f"{g['datastates']:.2f} vs {g['ceiling']:.2f} = {g['ratio']:.2f}"
                                             for g in r["rounds"]),
        f"  torch.load          {r['torch_load_s']:.2f}s = {r['torch_load_gbps']:.2f} GB/s",
        f"  DCP load            {r['dcp_load_s']:.2f}s = {r['dcp_load_gbps']:.2f} GB/s into existing tensors",
        f"  GPU targets' path   through reused slots {r['gpu_path_stream_s']:.2f}s vs a fresh buffer and copies"
        f" {r['gpu_path_fresh_buffer_s']:.2f}s = {r['gpu_path_stream_vs_fresh_buffer']:.2f}x faster"
        f" (run on host tensors; restore into them {r['gpu_path_stream_vs_restore']:.2f} of its speed)",
        f"  ratios              datastates/ceiling {r['datastates_vs_ceiling']:.2f} (target >= 0.90),"
        f" {r['datastates_vs_torch_load']:.1f}x faster than torch.load, {r['datastates_vs_dcp_load']:.1f}x than DCP",
    ]
    if "megatron_load_s_datastates" in r:
        gb = r["megatron_ckpt_bytes_datastates"] / 1e9
        lines.append(f"  Megatron-LM load    {gb:.2f} GB on {r['megatron_nproc']} ranks: cold datastates"
                     f" {r['megatron_load_s_datastates']:.2f}s vs torch_dist {r['megatron_load_s_torch_dist']:.2f}s"
                     f" = {r['megatron_load_speedup']:.2f}x (target >= 3); warm {r['megatron_load_s_datastates_warm']:.2f}s"
                     f" vs {r['megatron_load_s_torch_dist_warm']:.2f}s = {r['megatron_load_speedup_warm']:.2f}x")
        lines.append(f"  disk's limit        a plain cold read of the same files by {r['megatron_nproc']} processes"
                     f" {r['megatron_read_ceiling_s']:.2f}s: datastates at {r['megatron_load_vs_ceiling']:.2f} of it;"
                     f" no loader can beat torch_dist by more than {r['megatron_load_speedup_bound']:.2f}x here")
        lines.append(f"  + fresh moments     the same read with the Adam moments landing in fresh pages"
                     f" {r['megatron_fresh_read_ceiling_s']:.2f}s: no loader that allocates them can beat torch_dist"
                     f" by more than {r['megatron_load_speedup_fresh_bound']:.2f}x here; datastates at"
                     f" {r['megatron_load_vs_fresh_ceiling']:.2f} of it")
        lines.append(f"  + replicated model  and each process also reading the model shards another data-parallel"
                     f" rank wrote (every load needs them) {r['megatron_needed_read_ceiling_s']:.2f}s:"
                     f" datastates at {r['megatron_load_vs_needed_ceiling']:.2f} of it")
        lines.append(f"  in the ranks        the fresh-pages read done inside each Megatron-LM rank right before its"
                     f" load_checkpoint {r['megatron_in_rank_read_s']:.2f}s: datastates at"
                     f" {r['megatron_load_vs_in_rank_read']:.2f} of it (target >= 0.90)")
    elif "megatron_load_skipped" in r:
        lines.append(f"  Megatron-LM load    skipped: {r['megatron_load_skipped']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench restore``."""
    p.add_argument("--size-gb", type=POSITIVE, default=2.0, help="state size in GB (default 2)")
    p.add_argument("--threads", type=POSITIVE_INT, default=4, help="restore_threads of the engine (default 4)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help="rounds of the engine's restore and the reads it is compared with (default 3)")
    p.add_argument("--megatron", default="auto", choices=("auto", "on", "off"),
                   help="also time Megatron-LM's load_checkpoint, datastates vs torch_dist (auto: when the "
                        "Megatron-LM checkout is available)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    result = run(args.size_gb, args.dir, args.threads, args.repeats, args.megatron)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0 if result["datastates_bit_exact"] else 1
