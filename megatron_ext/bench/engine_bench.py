"""``megatron-ext bench engine``: this engine against torch.save, DCP async_save (plain, and with a
``DefaultStager`` staging asynchronously: DCP's own lazy snapshot), torch_checkpointing and
O_DIRECT, in one run.

All six write the same in-memory state of G GB to the same file system, one after the other, in
one process. The figures that matter are ratios measured in this run (blocking vs. DCP's,
flush GB/s vs. the direct write's), since absolute numbers drift between machines and runs.
The modes alternate over ``--repeats`` rounds (default 3, the order reversed every other round);
every figure is measured once per round (a ratio within its round) and reported as its median
over the rounds, ``<figure>_by_round`` and ``<figure>_spread`` (max - min). The physical limits
of memory (``memcpy_gbps``, ``d2h_gbps``) are measured once, before the rounds.

``torch_checkpointing`` is meta-pytorch's ``CheckpointManager`` at its best documented setting
(``bench/torch_checkpointing_peer.py``); one untimed save first starts its writer subprocess (a
trainer pays that once), then the timed one: blocked is the call plus the wait of
``manager.lock()`` after the compute, as the engine's is ``save`` plus ``wait_snapshot``. Where it
cannot run, ``skipped`` says why and its figures are absent.

``--device cuda`` puts the state on the current GPU (the engine then copies it device-to-host on
its own stream into its pinned host cache while the caller's matmuls run on the GPU) and adds the
device-to-host limit, ``d2h_gbps`` (copies into pinned memory); the JSON keys are the same on both
devices (``d2h_gbps`` is null on the CPU).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import shutil
import sys
import threading
import time

import psutil
import torch
import xxhash

from megatron_ext.arg_types import NONNEG, POSITIVE, POSITIVE_INT
from megatron_ext.bench import torch_checkpointing_peer
from megatron_ext.bench.common import (DEFAULT_REPEATS, PeakRss, busy_compute, direct_write_gbps,
                                       ensure_process_group, figures_over_rounds, fresh_dir, make_state, memcpy_gbps,
                                       round_order, state_bytes, working_dir)
from megatron_ext.engine import CheckpointEngine
from megatron_ext.engine.threads import os_thread_name, thread_cpu_seconds

NAME = "engine"
HELP = "engine vs torch.save, DCP async_save, torch_checkpointing and an O_DIRECT write"
#: The modes each round runs, in this order in even rounds and reversed in odd ones.
MODES = ("datastates", "torch_save", "dcp_async", "dcp_stager", "torch_checkpointing")


def _progress(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def compute(seconds: float, device: str) -> int:
    """The caller's forward/backward stand-in: matmuls on ``device`` for about ``seconds`` (GPU: then synchronised)."""
    if device == "cpu":
        return busy_compute(seconds)
    a = torch.randn(4096, 4096, device=device)
    b = torch.randn(4096, 4096, device=device)
    steps = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()
        steps += 8
    return steps


def d2h_gbps(device: str, nbytes: int = 256 << 20) -> float | None:
    """Device-to-host copies into pinned memory: the snapshot's physical limit on a GPU (None on CPU)."""
    if device == "cpu":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * nbytes / (time.perf_counter() - start) / 1e9


def measure_datastates(state: dict[str, torch.Tensor], directory: str, cache_gb: float | None = None,
                       compute_s: float = 1.0, device: str = "cpu", flush_process: bool = True) -> dict:
    """One lazy save of ``state`` while the caller computes for ``compute_s``: blocked, snapshot,
    flush, CPU; then a second one (``warm``): its flush and CPU. ``flush_process``: flush from the
    I/O worker process (the default) or from threads of this one."""
    nbytes = state_bytes(state)
    cache_gb = cache_gb if cache_gb is not None else max(nbytes / 2**30 * 1.02, 0.01)
    ds_dir = fresh_dir(directory)
    with PeakRss() as rss:
        engine = CheckpointEngine({"host_cache_size": cache_gb, "save_dir": ds_dir,
                                   "flush_process": flush_process}, rank=0, world_size=1)
        engine.cache.wait_allocated(600)  # a long-running trainer allocates once, long before
        cpu0 = process_cpu_s()
        t0 = time.perf_counter()
        engine.save(state, "step1")
        t_save = time.perf_counter() - t0
        compute_cpu0 = time.thread_time()
        steps = compute(compute_s, device)
        compute_cpu = time.thread_time() - compute_cpu0
        blocked_wait = engine.wait_snapshot()
        t_snapshot = time.perf_counter() - t0
        engine.commit("step1")
        engine.wait_persisted()
        t_persisted = time.perf_counter() - t0
        # The engine's CPU: this process's (its threads, and the training thread inside its calls)
        # less the caller's compute, plus the I/O worker's whole life (it starts at the first write).
        engine_cpu = process_cpu_s() - cpu0 - compute_cpu + worker_cpu_s(engine)
        # The same save again: what every later checkpoint of a trainer at --save-interval 1 costs
        # (the I/O worker runs and has the cache's pages mapped already).
        cpu0, worker0, copy0 = process_cpu_s(), worker_cpu_s(engine), copy_cpu_s()
        engine.save(state, "step2")
        compute_cpu0 = time.thread_time()
        compute(compute_s, device)
        compute_cpu = time.thread_time() - compute_cpu0
        engine.wait_snapshot()
        engine.commit("step2")
        engine.wait_persisted()
        warm_cpu = process_cpu_s() - cpu0 - compute_cpu + worker_cpu_s(engine) - worker0
        warm_copy_cpu = copy_cpu_s() - copy0
        records = {(r["event"], r["level"], r["checkpoint"]): r for r in engine.telemetry.records}
        engine.shutdown()
    flush = records[("flush", "shared", "step1")]
    warm_flush = records[("flush", "shared", "step2")]
    result = {
        "host_cache_bytes": engine.cache.nbytes,
        "datastates_save_call_s": t_save,
        "datastates_blocking_s": t_save + blocked_wait,
        "datastates_snapshot_s": t_snapshot,
        "datastates_compute_s": compute_s,
        "datastates_compute_steps": steps,
        "datastates_persisted_s": t_persisted,
        "datastates_flush_s": flush["seconds"],
        "datastates_flush_gbps": flush["gbps"],
        "datastates_cpu_s_per_gb": engine_cpu / (nbytes / 1e9),
        "datastates_warm_flush_gbps": warm_flush["gbps"],
        "datastates_warm_cpu_s_per_gb": warm_cpu / (nbytes / 1e9),
        "datastates_warm_copy_cpu_s_per_gb": warm_copy_cpu / (nbytes / 1e9),
        "peak_rss_bytes": rss.peak,
    }
    del engine
    gc.collect()
    return result


def process_cpu_s() -> float:
    """User + system CPU seconds of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker_cpu_s(engine: CheckpointEngine) -> float:
    """User + system CPU seconds of the engine's I/O worker process (0 without one), read while it lives."""
    pid = getattr(engine.pipeline.io, "pid", None)
    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def copy_cpu_s() -> float:
    """CPU seconds so far of the threads that copy into the host cache: the engine's snapshot thread
    and the OpenMP threads torch adds to its copies (a large ``copy_`` from a thread other than the
    main one runs on a team of its own, which did about half the bytes here). Those threads carry the
    snapshot thread's OS name (``engine/threads.py``; Linux gives a new thread its creator's), so they
    are read from ``/proc`` by that name (at the kernel's tick); the snapshot thread itself from its
    own clock. On a GPU node the device-to-host copy engine moves these bytes and the snapshot
    thread only queues them."""
    snapshot = next((t for t in threading.enumerate() if t.name == "datastates-snapshot" and t.ident), None)
    own = time.clock_gettime(time.pthread_getcpuclockid(snapshot.ident)) if snapshot else 0.0
    name = os_thread_name("datastates-snapshot")
    return own + thread_cpu_seconds(lambda n: n == name, skip=snapshot.native_id if snapshot else None)


def cpu_floor_s_per_gb(state: dict[str, torch.Tensor], directory: str) -> dict:
    """The least CPU a checkpoint of ``state`` can take, per GB: one xxh3-64 pass over its bytes
    and one O_DIRECT write of as many bytes, each on this thread (its own CPU clock). It is also the
    format's floor: from format 3 one pass gives the file's and every tensor's digest (docs/FORMAT.md)."""
    nbytes = state_bytes(state)
    views = [memoryview((t if t.device.type == "cpu" else t.cpu()).contiguous().view(torch.uint8).numpy())
             for t in state.values()]
    start = time.thread_time()
    for view in views:
        xxhash.xxh3_64(view).hexdigest()
    hashed = time.thread_time() - start
    start = time.thread_time()
    direct_write_gbps(directory, nbytes, repeats=1)
    written = time.thread_time() - start
    gb = nbytes / 1e9
    return {"floor_checksum_cpu_s_per_gb": hashed / gb, "floor_write_cpu_s_per_gb": written / gb,
            "floor_cpu_s_per_gb": (hashed + written) / gb}


def measure_torch_save(state: dict[str, torch.Tensor], directory: str) -> float:
    """Seconds ``torch.save`` + fsync blocks (DeepSpeed's default engine saves this way)."""
    path = os.path.join(fresh_dir(directory), "state.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def measure_dcp_async(state: dict[str, torch.Tensor], directory: str, executor: str = "thread",
                      device: str = "cpu") -> dict:
    """``torch.distributed.checkpoint.async_save`` with the ``thread`` or ``process`` executor.

    Returns the seconds the call blocked (staging) and until the future resolved (on disk).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    ensure_process_group(os.path.dirname(os.path.abspath(directory)), device)
    kind = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}[executor]
    dcp_dir = fresh_dir(directory)
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=dcp_dir, async_checkpointer_type=kind)
    blocked = time.perf_counter() - t0
    future.result(timeout=3600)
    return {"blocking_s": blocked, "done_s": time.perf_counter() - t0}


def measure_dcp_stager(state: dict[str, torch.Tensor], directory: str, compute_s: float = 1.0,
                       device: str = "cpu") -> dict:
    """DCP at its best for a lazy snapshot: ``async_save`` with a ``DefaultStager`` doing asynchronous
    staging (pinned buffers and non-blocking copies on a GPU), the caller computing meanwhile.

    Blocked time counts the call and the wait on ``staging_completion`` after the compute (the point
    where a trainer's optimizer step may change the tensors), as the engine's counts ``save`` and
    ``wait_snapshot``; ``done_s`` runs until the upload completed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    ensure_process_group(os.path.dirname(os.path.abspath(directory)), device)
    gpu = device == "cuda"
    stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=gpu))
    dcp_dir = fresh_dir(directory)
    try:
        t0 = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=dcp_dir, async_stager=stager)
        call = time.perf_counter() - t0
        compute(compute_s, device)
        t1 = time.perf_counter()
        response.staging_completion.result(timeout=3600)
        waited = time.perf_counter() - t1
        staged = time.perf_counter() - t0
        response.upload_completion.result(timeout=3600)
        done = time.perf_counter() - t0
    finally:
        stager.close()
    return {"blocking_s": call + waited, "call_s": call, "staged_s": staged, "done_s": done}


def measure_torch_checkpointing(state: dict[str, torch.Tensor], directory: str, compute_s: float = 1.0,
                                device: str = "cpu") -> dict:
    """torch_checkpointing's manager (its best documented setting) saving ``state`` while the caller computes.

    One untimed save first (its writer subprocess starts then); then the timed one: the call, the
    compute, the wait of ``manager.lock()`` (where an optimizer step would go), until written."""
    peer = torch_checkpointing_peer.Saver(state, fresh_dir(directory), device)
    try:
        peer.save(state, "warmup").result(timeout=3600)
        t0 = time.perf_counter()
        write = peer.save(state, "step1")
        call = time.perf_counter() - t0
        compute(compute_s, device)
        t1 = time.perf_counter()
        with peer.update():
            waited = time.perf_counter() - t1
        staged = time.perf_counter() - t0
        write.result(timeout=3600)
        done = time.perf_counter() - t0
    finally:
        peer.close()
    return {"blocking_s": call + waited, "call_s": call, "staged_s": staged, "done_s": done}


def measure_round(state: dict[str, torch.Tensor], base: str, modes, cache_gb: float | None, compute_s: float,
                  device: str, flush_process: bool, rss_state: int) -> dict:
    """Every mode once in the order ``modes``, and the ratios of this round."""
    nbytes = state_bytes(state)
    result: dict = {}
    for mode in modes:
        # Each mode meets an idle disk: the previous mode's dirty pages (a peer that does not fsync
        # every file, the files removed) written back first, not during this mode's writes.
        os.sync()
        if mode == "datastates":
            _progress("O_DIRECT write of the same bytes, the datastates engine, the write again and the CPU floor")
            direct_before = direct_write_gbps(fresh_dir(os.path.join(base, "direct")), nbytes, repeats=1)
            result.update(measure_datastates(state, os.path.join(base, "datastates"), cache_gb, compute_s, device,
                                             flush_process))
            # The disk's speed drifts: the limit is the mean of direct writes just before and just after.
            direct_after = direct_write_gbps(fresh_dir(os.path.join(base, "direct")), nbytes, repeats=1)
            result["direct_write_gbps_before"] = direct_before
            result["direct_write_gbps_after"] = direct_after
            result["direct_write_gbps"] = (direct_before + direct_after) / 2
            result.update(cpu_floor_s_per_gb(state, fresh_dir(os.path.join(base, "direct"))))
        elif mode == "torch_save":
            _progress("torch.save + fsync")
            result["torch_save_s"] = measure_torch_save(state, os.path.join(base, "torch_save"))
        elif mode == "dcp_async":
            _progress("torch.distributed.checkpoint.async_save")
            dcp_result = measure_dcp_async(state, os.path.join(base, "dcp"), device=device)
            result["dcp_async_blocking_s"] = dcp_result["blocking_s"]
            result["dcp_async_done_s"] = dcp_result["done_s"]
        elif mode == "dcp_stager":
            _progress("torch.distributed.checkpoint.async_save with DefaultStager (asynchronous staging)")
            stager_result = measure_dcp_stager(state, os.path.join(base, "dcp_stager"), compute_s, device)
            for key in ("blocking_s", "call_s", "staged_s", "done_s"):
                result[f"dcp_stager_{key}"] = stager_result[key]
        elif mode == "torch_checkpointing":
            _progress("torch_checkpointing CheckpointManager (async staging into shared memory, its writer process)")
            try:
                peer = measure_torch_checkpointing(state, os.path.join(base, "torch_checkpointing"), compute_s,
                                                   device)
            except Exception as exc:  # noqa: BLE001 - a peer's failure is reported (skipped), the others run
                result["torch_checkpointing_failed"] = f"{type(exc).__name__}: {exc}"
            else:
                for key in ("blocking_s", "call_s", "staged_s", "done_s"):
                    result[f"torch_checkpointing_{key}"] = peer[key]
            shutil.rmtree(os.path.join(base, "torch_checkpointing"), ignore_errors=True)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    for peer in ("dcp", "dcp_stager", "torch_checkpointing"):
        blocked = result.get(f"{'dcp_async' if peer == 'dcp' else peer}_blocking_s")
        if blocked is not None:
            result[f"ratio_blocking_vs_{peer}"] = result["datastates_blocking_s"] / blocked
    result["ratio_flush_vs_direct"] = result["datastates_flush_gbps"] / result["direct_write_gbps"]
    result["ratio_cpu_vs_floor"] = result["datastates_cpu_s_per_gb"] / result["floor_cpu_s_per_gb"]
    result["ratio_warm_flush_vs_direct"] = result["datastates_warm_flush_gbps"] / result["direct_write_gbps"]
    result["ratio_warm_cpu_vs_floor"] = result["datastates_warm_cpu_s_per_gb"] / result["floor_cpu_s_per_gb"]
    result["ratio_warm_cpu_besides_copy_vs_floor"] = ((result["datastates_warm_cpu_s_per_gb"]
                                                      - result["datastates_warm_copy_cpu_s_per_gb"])
                                                     / result["floor_cpu_s_per_gb"])
    result["ratio_rss_vs_state_plus_cache"] = result["peak_rss_bytes"] / (rss_state + result["host_cache_bytes"])
    return result


def run(size_gb: float, directory: str | None = None, cache_gb: float | None = None,
        compute_s: float = 1.0, device: str = "cpu", flush_process: bool = True,
        repeats: int = DEFAULT_REPEATS, modes: tuple[str, ...] = MODES) -> dict:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA device (none is visible to torch here)")
    if "datastates" not in modes or set(modes) - set(MODES):
        raise ValueError(f"modes must include datastates and be among {', '.join(MODES)}, got {modes}")
    with working_dir(directory, "megatron-ext-bench-") as base:
        torch.manual_seed(0)
        _progress(f"building a {size_gb} GB state on {device}")
        state = {k: v.to(device) for k, v in make_state(int(size_gb * 1e9)).items()}
        gc.collect()
        nbytes = state_bytes(state)
        rss_state = PeakRss().peak
        result: dict = {"state_bytes": nbytes, "rss_with_state_bytes": rss_state, "device": device,
                        "flush_process": flush_process}

        _progress("physical limits: memcpy and device-to-host copy (GPU)")
        result["memcpy_gbps"] = memcpy_gbps()
        result["d2h_gbps"] = d2h_gbps(device)
        result["repeats"] = repeats
        result["load_average_before"] = list(os.getloadavg())
        skipped: dict[str, str] = {}
        if "torch_checkpointing" in modes and torch_checkpointing_peer.missing():
            skipped["torch_checkpointing"] = torch_checkpointing_peer.missing()
        modes = [m for m in MODES if m in modes and m not in skipped]
        rounds = []
        for rnd in range(repeats):
            order = round_order(modes, rnd)
            _progress(f"round {rnd + 1}/{repeats}: {', '.join(order)}")
            got = measure_round(state, base, order, cache_gb, compute_s, device, flush_process, rss_state)
            if "torch_checkpointing_failed" in got:  # named with its reason; not run in the later rounds
                skipped["torch_checkpointing"] = f"round {rnd + 1}: {got['torch_checkpointing_failed']}"
                _progress(f"torch_checkpointing skipped: {skipped['torch_checkpointing']}")
                modes.remove("torch_checkpointing")
            rounds.append(got)
        if "torch_checkpointing" in skipped:
            rounds = [{k: v for k, v in r.items() if not k.startswith(("torch_checkpointing_",
                                                                        "ratio_blocking_vs_torch_checkpointing"))}
                      for r in rounds]
        result.update(figures_over_rounds(rounds))
        result["skipped"] = skipped
        result["load_average_after"] = list(os.getloadavg())
        result["workdir"] = base
        return result


#: The figures' limits (docs/BENCHMARKS.md): (key, "<=" or ">=", bound). ``scripts/gpu_check.sh`` and
#: ``--check`` fail a run outside them; exiting 0 alone says only that the run finished.
LIMITS = (("ratio_blocking_vs_dcp", "<=", 0.02), ("ratio_flush_vs_direct", ">=", 0.90),
          ("ratio_rss_vs_state_plus_cache", "<=", 1.10))
#: On a GPU the snapshot hides under the caller's compute: at most ``--compute-s`` plus twice the
#: state's device-to-host time at the measured limit, plus this much (seconds) of thread start-up.
SNAPSHOT_SLACK_S = 0.5


def check_limits(r: dict) -> list[str]:
    """The limits ``r`` breaks, one readable line each (empty: all kept)."""
    broken = []
    for key, op, bound in LIMITS:
        value = r.get(key)
        if value is None:
            broken.append(f"{key} not measured (limit {op} {bound}): run its modes")
            continue
        if not (value <= bound if op == "<=" else value >= bound):
            broken.append(f"{key} {value:.4g} (limit {op} {bound})")
    if r.get("d2h_gbps"):
        bound = r["datastates_compute_s"] + 2 * r["state_bytes"] / 1e9 / r["d2h_gbps"] + SNAPSHOT_SLACK_S
        if r["datastates_snapshot_s"] > bound:
            broken.append(f"datastates_snapshot_s {r['datastates_snapshot_s']:.3f} (limit <= {bound:.3f}: compute "
                          f"+ 2 x state / d2h_gbps + {SNAPSHOT_SLACK_S})")
    return broken


def format_table(r: dict) -> str:
    r = collections.defaultdict(lambda: float("nan"), r)  # a mode not run (--modes) prints as nan
    gb = r["state_bytes"] / 1e9
    d2h = f", device-to-host {r['d2h_gbps']:.2f} GB/s" if r.get("d2h_gbps") else ""
    lines = [
        f"state {gb:.2f} GB on {r['device']}, host cache {r['host_cache_bytes'] / 2**30:.2f} GiB; medians of "
        f"{r.get('repeats', 1)} rounds (load average {r.get('load_average_before', [0])[0]:.2f})",
        f"  physical limits     memcpy {r['memcpy_gbps']:.2f} GB/s{d2h}, O_DIRECT write {r['direct_write_gbps']:.2f} GB/s",
        f"  datastates          blocked {r['datastates_blocking_s']:.4f}s (save() {r['datastates_save_call_s']:.4f}s),"
        f" snapshot {r['datastates_snapshot_s']:.2f}s, persisted {r['datastates_persisted_s']:.2f}s,"
        f" flush {r['datastates_flush_gbps']:.2f} GB/s, CPU {r['datastates_cpu_s_per_gb']:.3f} s/GB",
        f"  datastates again    flush {r['datastates_warm_flush_gbps']:.2f} GB/s, CPU {r['datastates_warm_cpu_s_per_gb']:.3f} s/GB"
        f" (the I/O worker running, the cache mapped: every later checkpoint), of which the copy into the cache"
        f" {r['datastates_warm_copy_cpu_s_per_gb']:.3f} s/GB",
        f"  CPU floor           {r['floor_cpu_s_per_gb']:.3f} s/GB (xxh3-64 pass {r['floor_checksum_cpu_s_per_gb']:.3f},"
        f" O_DIRECT write {r['floor_write_cpu_s_per_gb']:.3f})",
        f"  torch.save+fsync    {r['torch_save_s']:.2f}s (blocking)",
        f"  DCP async_save      blocked {r['dcp_async_blocking_s']:.2f}s, done {r['dcp_async_done_s']:.2f}s",
        f"  DCP + DefaultStager blocked {r['dcp_stager_blocking_s']:.4f}s (call {r['dcp_stager_call_s']:.4f}s,"
        f" staged {r['dcp_stager_staged_s']:.2f}s), done {r['dcp_stager_done_s']:.2f}s",
        (f"  torch_checkpointing blocked {r['torch_checkpointing_blocking_s']:.4f}s (call "
         f"{r['torch_checkpointing_call_s']:.4f}s, staged {r['torch_checkpointing_staged_s']:.2f}s), done "
         f"{r['torch_checkpointing_done_s']:.2f}s" if "torch_checkpointing_blocking_s" in r else
         f"  torch_checkpointing not run: {r.get('skipped', {}).get('torch_checkpointing', 'not in --modes')}"),
        f"  ratios              blocking/DCP {r['ratio_blocking_vs_dcp']:.4f} (target <= 0.02),"
        f" blocking/DCP+stager {r['ratio_blocking_vs_dcp_stager']:.3f},"
        + (f" blocking/torch_checkpointing {r['ratio_blocking_vs_torch_checkpointing']:.3f},"
           if "ratio_blocking_vs_torch_checkpointing" in r else "") +
        f" flush/direct {r['ratio_flush_vs_direct']:.2f} (target >= 0.90),"
        f" CPU/floor {r['ratio_cpu_vs_floor']:.2f} (target <= 1.30),"
        f" again: flush/direct {r['ratio_warm_flush_vs_direct']:.2f}, CPU/floor {r['ratio_warm_cpu_vs_floor']:.2f}"
        f" ({r['ratio_warm_cpu_besides_copy_vs_floor']:.2f} besides the copy, a GPU's copy engine's work),"
        f" peak RSS/(state+cache) {r['ratio_rss_vs_state_plus_cache']:.2f} (target <= 1.10)",
    ]
    return "\n".join(lines)


def plot_cpu_vs_floor(r: dict, path: str) -> str:
    """The engine's CPU seconds per GB, first and later save, beside the floor of the same run: what
    checksumming and writing the bytes cost at least (issue 41's ``CPU / floor`` as bars)."""
    from .plots import grouped_bars

    floor = r["floor_cpu_s_per_gb"]
    return grouped_bars(
        path, f"bench engine: CPU per GB against the floor ({r['state_bytes'] / 1e9:.1f} GB, {r['device']})",
        ["first save", "later saves"],
        {"xxh3 pass + O_DIRECT write (limit)": [floor, floor],
         "engine, all threads": [r["datastates_cpu_s_per_gb"], r["datastates_warm_cpu_s_per_gb"]],
         "engine besides the copy": [None, r["datastates_warm_cpu_s_per_gb"] - r["datastates_warm_copy_cpu_s_per_gb"]]},
        "CPU seconds per GB")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench engine``."""
    p.add_argument("--size-gb", type=POSITIVE, default=2.0, help="state size in GB (default 2)")
    p.add_argument("--cache-gb", type=POSITIVE, default=None, help="host cache in GiB (default: the state size)")
    p.add_argument("--compute-s", type=NONNEG, default=1.0,
                   help="seconds the caller computes between save and wait_snapshot (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the state lives (cuda: on the current GPU, copied by the CUDA copy stream)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help=f"rounds of every mode, order reversed every other; medians (default {DEFAULT_REPEATS})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="modes to run, datastates among them (default all)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--flush-in-process", action="store_true",
                   help="flush from threads of the training process (flush_process: false), not the I/O worker")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the engine's CPU per GB against the floor (xxh3 pass + O_DIRECT write) there")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a figure is outside its limit (LIMITS; the broken ones go to stderr)")


def main(args) -> int:
    device = getattr(args, "device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench engine --device cuda: no CUDA device is visible to torch here", file=sys.stderr)
        return 2
    result = run(args.size_gb, args.dir, args.cache_gb, args.compute_s, device,
                 not getattr(args, "flush_in_process", False), getattr(args, "repeats", DEFAULT_REPEATS),
                 tuple(getattr(args, "modes", MODES)))
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    if getattr(args, "plot", None):
        print(f"bench engine: wrote {plot_cpu_vs_floor(result, args.plot)}", file=sys.stderr)
    broken = check_limits(result) if getattr(args, "check", False) else []
    for line in broken:
        print(f"bench engine: outside its limit: {line}", file=sys.stderr)
    return 1 if broken else 0
