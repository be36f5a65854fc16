"""``megatron-ext bench engine``: this engine against torch.save, DCP async_save and O_DIRECT, in one run.

All four write the same in-memory state of G GB to the same file system, one after the other, in
one process. The figures that matter are ratios measured in this run (blocking vs. DCP's,
flush GB/s vs. the direct write's), since absolute numbers drift between machines and runs.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

import torch

from megatron_ext.bench.common import (PeakRss, busy_compute, direct_write_gbps, fresh_dir, make_state,
                                       memcpy_gbps, state_bytes)
from megatron_ext.engine import CheckpointEngine


def _progress(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def _ensure_process_group(workdir: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'pg-store')}",
                                rank=0, world_size=1)


def run(size_gb: float, directory: str | None = None, cache_gb: float | None = None,
        compute_s: float = 1.0) -> dict:
    base = directory or tempfile.mkdtemp(prefix="megatron-ext-bench-", dir=os.getcwd())
    os.makedirs(base, exist_ok=True)
    torch.manual_seed(0)
    _progress(f"building a {size_gb} GB state")
    state = make_state(int(size_gb * 1e9))
    nbytes = state_bytes(state)
    rss_state = PeakRss().peak
    result: dict = {"state_bytes": nbytes, "rss_with_state_bytes": rss_state}

    _progress("physical limits: memcpy and O_DIRECT write of the same bytes")
    result["memcpy_gbps"] = memcpy_gbps()
    direct_before = direct_write_gbps(fresh_dir(os.path.join(base, "direct")), nbytes, repeats=1)

    cache_gb = cache_gb if cache_gb is not None else max(nbytes / 2**30 * 1.02, 0.01)
    _progress(f"datastates engine, host cache {cache_gb:.2f} GB")
    ds_dir = fresh_dir(os.path.join(base, "datastates"))
    with PeakRss() as rss:
        engine = CheckpointEngine({"host_cache_size": cache_gb, "save_dir": ds_dir}, rank=0, world_size=1)
        engine.cache.wait_allocated(600)  # a long-running trainer allocates once, long before
        t0 = time.perf_counter()
        engine.save(state, "step1")
        t_save = time.perf_counter() - t0
        steps = busy_compute(compute_s)
        blocked_wait = engine.wait_snapshot()
        t_snapshot = time.perf_counter() - t0
        engine.commit("step1")
        engine.wait_persisted()
        t_persisted = time.perf_counter() - t0
        records = {(r["event"], r["level"]): r for r in engine.telemetry.records}
        engine.shutdown()
    flush = records[("flush", "shared")]
    result.update({
        "host_cache_bytes": engine.cache.nbytes,
        "datastates_save_call_s": t_save,
        "datastates_blocking_s": t_save + blocked_wait,
        "datastates_snapshot_s": t_snapshot,
        "datastates_compute_s": compute_s,
        "datastates_compute_steps": steps,
        "datastates_persisted_s": t_persisted,
        "datastates_flush_s": flush["seconds"],
        "datastates_flush_gbps": flush["gbps"],
        "peak_rss_bytes": rss.peak,
    })
    del engine
    gc.collect()
    # The disk's speed drifts: the limit is the mean of direct writes just before and just after.
    direct_after = direct_write_gbps(fresh_dir(os.path.join(base, "direct")), nbytes, repeats=1)
    result["direct_write_gbps_before"] = direct_before
    result["direct_write_gbps_after"] = direct_after
    result["direct_write_gbps"] = (direct_before + direct_after) / 2

    _progress("torch.save + fsync")
    path = os.path.join(fresh_dir(os.path.join(base, "torch_save")), "state.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    result["torch_save_s"] = time.perf_counter() - t0

    _progress("torch.distributed.checkpoint.async_save")
    import torch.distributed.checkpoint as dcp

    _ensure_process_group(base)
    dcp_dir = fresh_dir(os.path.join(base, "dcp"))
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=dcp_dir)
    result["dcp_async_blocking_s"] = time.perf_counter() - t0
    future.result()
    result["dcp_async_done_s"] = time.perf_counter() - t0

    result["ratio_blocking_vs_dcp"] = result["datastates_blocking_s"] / result["dcp_async_blocking_s"]
    result["ratio_flush_vs_direct"] = result["datastates_flush_gbps"] / result["direct_write_gbps"]
    result["ratio_rss_vs_state_plus_cache"] = result["peak_rss_bytes"] / (rss_state + result["host_cache_bytes"])
    result["workdir"] = base
    if directory is None:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return result


def format_table(r: dict) -> str:
    gb = r["state_bytes"] / 1e9
    lines = [
        f"state {gb:.2f} GB, host cache {r['host_cache_bytes'] / 2**30:.2f} GiB",
        f"  physical limits     memcpy {r['memcpy_gbps']:.2f} GB/s, O_DIRECT write {r['direct_write_gbps']:.2f} GB/s",
        f"  datastates          blocked {r['datastates_blocking_s']:.4f}s (save() {r['datastates_save_call_s']:.4f}s),"
        f" snapshot {r['datastates_snapshot_s']:.2f}s, persisted {r['datastates_persisted_s']:.2f}s,"
        f" flush {r['datastates_flush_gbps']:.2f} GB/s",
        f"  torch.save+fsync    {r['torch_save_s']:.2f}s (blocking)",
        f"  DCP async_save      blocked {r['dcp_async_blocking_s']:.2f}s, done {r['dcp_async_done_s']:.2f}s",
        f"  ratios              blocking/DCP {r['ratio_blocking_vs_dcp']:.4f} (target <= 0.02),"
        f" flush/direct {r['ratio_flush_vs_direct']:.2f} (target >= 0.90),"
        f" peak RSS/(state+cache) {r['ratio_rss_vs_state_plus_cache']:.2f} (target <= 1.10)",
    ]
    return "\n".join(lines)


def main(args) -> int:
    result = run(args.size_gb, args.dir, args.cache_gb, args.compute_s)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
