"""``megatron-ext bench restore``: this engine's restore against torch.load, DCP load and an O_DIRECT read.

The same in-memory state of G GB is saved once by each (this engine, ``torch.save``,
``torch.distributed.checkpoint.save``), then read back one after the other in one process. Before
every timed read the files' pages are dropped from the page cache, so each figure is a cold read
from the disk. The physical limit is one sequential ``O_DIRECT`` read of the engine's file (the
same bytes), measured just before and just after the engine's restore. Like DCP's ``load``, the
engine's restore fills existing tensors (``load_into``: a trainer restores into its live model);
``torch.load`` and the engine's ``load`` allocate new ones, whose first touch costs page faults.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import json
import mmap
import os
import shutil
import sys
import tempfile
import time

import torch

from megatron_ext.bench.common import fresh_dir, make_state, state_bytes
from megatron_ext.bench.engine_bench import _ensure_process_group
from megatron_ext.engine import CheckpointEngine
from megatron_ext.engine.fast_read import open_for_read


def _progress(msg: str) -> None:
    print(f"[bench restore] {msg}", file=sys.stderr, flush=True)


def drop_page_cache(directory: str) -> None:
    """Evict every file under ``directory`` from the page cache (clean pages go with DONTNEED)."""
    for parent, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def buffered_read_gbps(path: str) -> float:
    """One buffered sequential read of ``path`` (to show whether the cache was dropped)."""
    buf = bytearray(16 << 20)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return os.path.getsize(path) / (time.perf_counter() - start) / 1e9


def direct_read_gbps(path: str, threads: int = 1, chunk_bytes: int = 16 << 20) -> float:
    """The physical limit: ``threads`` threads reading ``path`` in ``chunk_bytes`` requests with O_DIRECT
    (buffered if refused) into reused buffers; one thread = one sequential stream."""
    size = os.path.getsize(path)
    buffers = [mmap.mmap(-1, chunk_bytes) for _ in range(threads)]
    drop_page_cache(os.path.dirname(path))
    start = time.perf_counter()
    fd, _ = open_for_read(path, "auto")

    def reader(i: int) -> None:
        for offset in range(i * chunk_bytes, size, threads * chunk_bytes):
            if os.preadv(fd, [buffers[i]], offset) <= 0:
                raise OSError(f"short read of {path} at {offset}")

    try:
        with cf.ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(reader, i) for i in range(threads)]:
                future.result(timeout=3600)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    for buf in buffers:
        buf.close()
    return size / elapsed / 1e9


def _timed(directory: str, load) -> tuple[float, object]:
    drop_page_cache(directory)
    gc.collect()
    start = time.perf_counter()
    result = load()
    return time.perf_counter() - start, result


def run(size_gb: float, directory: str | None = None, threads: int = 4) -> dict:
    base = directory or tempfile.mkdtemp(prefix="megatron-ext-bench-restore-", dir=os.getcwd())
    os.makedirs(base, exist_ok=True)
    _progress(f"building a {size_gb} GB state and saving it three ways")
    state = make_state(int(size_gb * 1e9))
    nbytes = state_bytes(state)
    result: dict = {"state_bytes": nbytes, "restore_threads": threads}

    ds_dir = fresh_dir(os.path.join(base, "datastates"))
    config = {"save_dir": ds_dir, "host_cache_size": max(nbytes / 2**30 * 1.02, 0.01), "restore_threads": threads}
    with CheckpointEngine(config, rank=0, world_size=1) as engine:
        engine.save_and_commit(state, "step1")
        engine.wait_persisted()
    pt_path = os.path.join(fresh_dir(os.path.join(base, "torch_save")), "state.pt")
    with open(pt_path, "wb") as f:
        torch.save(state, f)
    import torch.distributed.checkpoint as dcp

    _ensure_process_group(base)
    dcp_dir = fresh_dir(os.path.join(base, "dcp"))
    dcp.save(state, checkpoint_id=dcp_dir)

    engine = CheckpointEngine({**config, "host_cache_size": 0.25, "remove_partial_on_start": False},
                              rank=0, world_size=1)
    engine.cache.wait_allocated(600)  # a trainer's engine allocates its cache long before a restore
    template = {k: torch.zeros_like(v) for k, v in state.items()}  # the live model's tensors (resident)
    tensor_file = os.path.join(ds_dir, engine.open_checkpoint("step1").manifest["files"]["rank00000"]["tensor_file"])
    _progress("page cache check: cold vs warm buffered read of the engine's file")
    drop_page_cache(ds_dir)
    result["buffered_cold_gbps"] = buffered_read_gbps(tensor_file)
    result["buffered_warm_gbps"] = buffered_read_gbps(tensor_file)

    _progress("O_DIRECT read, datastates restore, O_DIRECT read")
    direct_before = direct_read_gbps(tensor_file)
    seconds, loaded = _timed(ds_dir, lambda: engine.load_into("step1", template))
    result["datastates_restore_s"] = seconds
    result["datastates_restore_gbps"] = nbytes / seconds / 1e9
    result["datastates_bit_exact"] = all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))
                                         for k, v in state.items())
    del loaded
    direct_after = direct_read_gbps(tensor_file)
    result["direct_read_parallel_gbps"] = direct_read_gbps(tensor_file, threads)
    _progress("datastates load into new tensors")
    seconds, loaded = _timed(ds_dir, lambda: engine.load("step1"))
    result["datastates_load_new_tensors_s"] = seconds
    del loaded
    engine.shutdown()
    result["direct_read_gbps_before"] = direct_before
    result["direct_read_gbps_after"] = direct_after
    result["direct_read_gbps"] = (direct_before + direct_after) / 2

    _progress("torch.load")
    seconds, loaded = _timed(os.path.dirname(pt_path),
                             lambda: torch.load(pt_path, map_location="cpu", weights_only=True))
    result["torch_load_s"] = seconds
    del loaded

    _progress("torch.distributed.checkpoint.load")
    for t in template.values():
        t.zero_()
    seconds, _ = _timed(dcp_dir, lambda: dcp.load(template, checkpoint_id=dcp_dir))
    result["dcp_load_s"] = seconds
    del template

    result["torch_load_gbps"] = nbytes / result["torch_load_s"] / 1e9
    result["dcp_load_gbps"] = nbytes / result["dcp_load_s"] / 1e9
    result["datastates_vs_direct"] = result["datastates_restore_gbps"] / result["direct_read_gbps"]
    result["datastates_vs_direct_parallel"] = result["datastates_restore_gbps"] / result["direct_read_parallel_gbps"]
    result["datastates_vs_torch_load"] = result["torch_load_s"] / result["datastates_restore_s"]
    result["datastates_vs_dcp_load"] = result["dcp_load_s"] / result["datastates_restore_s"]
    result["workdir"] = base
    if directory is None:
        shutil.rmtree(base, ignore_errors=True)
    return result


def format_table(r: dict) -> str:
    gb = r["state_bytes"] / 1e9
    return "\n".join([
        f"state {gb:.2f} GB, cold reads (page cache dropped before each; buffered cold "
        f"{r['buffered_cold_gbps']:.2f} GB/s vs warm {r['buffered_warm_gbps']:.2f} GB/s)",
        f"  physical limit      O_DIRECT sequential read {r['direct_read_gbps']:.2f} GB/s,"
        f" with {r['restore_threads']} threads {r['direct_read_parallel_gbps']:.2f} GB/s",
        f"  datastates restore  {r['datastates_restore_s']:.2f}s = {r['datastates_restore_gbps']:.2f} GB/s"
        f" into existing tensors ({r['restore_threads']} threads, bit-exact: {r['datastates_bit_exact']});"
        f" {r['datastates_load_new_tensors_s']:.2f}s into new tensors",
        f"  torch.load          {r['torch_load_s']:.2f}s = {r['torch_load_gbps']:.2f} GB/s",
        f"  DCP load            {r['dcp_load_s']:.2f}s = {r['dcp_load_gbps']:.2f} GB/s into existing tensors",
        f"  ratios              datastates/direct {r['datastates_vs_direct']:.2f} (target >= 0.90),"
        f" /direct with {r['restore_threads']} threads {r['datastates_vs_direct_parallel']:.2f},"
        f" {r['datastates_vs_torch_load']:.1f}x faster than torch.load, {r['datastates_vs_dcp_load']:.1f}x than DCP",
    ])


def main(args) -> int:
    result = run(args.size_gb, args.dir, args.threads)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0 if result["datastates_bit_exact"] else 1
