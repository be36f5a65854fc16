"""``megatron-ext bench object-store``: the engine flushing to an S3 server against the S3 client alone, in one run.

The server is a local SeaweedFS (``megatron_ext.testing.s3_server``) started for the run, so both
modes meet the same server, disk and CPUs; where the ``weed`` binary is missing, ``skipped`` says
so and no figure is measured. ``client_alone`` uploads the state's bytes from host memory through
``object_store.Upload`` in runs of ``CONCURRENCY`` x ``PART_BYTES`` (every part of a run in flight
at once): what the level's client can do here, the limit. ``datastates`` is a ``CheckpointEngine``
saving the same state to ``s3://bench/...`` and committing, nothing else running: the flush's GB/s
over the client's (``ratio_flush_vs_client_alone``, target >= 0.9). ``datastates_training`` is the
same save while the caller computes for ``--compute-s`` (a training step): training blocked
(``save`` + ``wait_snapshot``) and durable (``wait_persisted``). Here the server shares the
machine's cores, so the flush overlapped with that compute measures the competition for them, not
the flush: that is why the ratio is taken from the run without it.

The modes alternate over ``--repeats`` rounds (reversed every other round); each figure is its
median over the rounds with ``_by_round`` and ``_spread`` (docs/BENCHMARKS.md, Method).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import torch

from megatron_ext.arg_types import NONNEG, POSITIVE, POSITIVE_INT
from megatron_ext.bench.common import (DEFAULT_REPEATS, busy_compute, figures_over_rounds, make_state, round_order,
                                       state_bytes, working_dir)

NAME = "object-store"
HELP = "engine flushing to a local S3 server (SeaweedFS) vs the S3 client alone uploading the same bytes"
#: The modes each round runs, in this order in even rounds and reversed in odd ones.
MODES = ("client_alone", "datastates", "datastates_training")
BUCKET = "bench"
#: The server's Go heap soft limit for the bench: a lower one makes it collect garbage all the
#: time under 8 parts of 16 MiB in flight, and the server, not the client, would be measured.
SERVER_MEMORY_MB = 2048


def _progress(msg: str) -> None:
    print(f"[bench object-store] {msg}", file=sys.stderr, flush=True)


class ServerRss:
    """The server process's peak resident memory, sampled on a thread while a mode runs."""

    def __init__(self, pid: int, interval_s: float = 0.02):
        self._proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self._proc.memory_info().rss)
            if self._stop.wait(interval_s):
                return

    def __enter__(self) -> "ServerRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def pointed_at(server):
    """This process's environment (and so its children's) set for ``server``'s admin identity,
    restored afterwards; the object store's cached clients are dropped both times."""
    from megatron_ext.engine import object_store
    from megatron_ext.testing.s3_server import COMPETING_VARIABLES

    saved = {name: os.environ.get(name) for name in (*COMPETING_VARIABLES, *server.env())}
    server.apply_env(os.environ)
    object_store.reset_clients()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        object_store.reset_clients()


def measure_client_alone(buffer, url: str) -> dict:
    """``buffer`` (host memory) uploaded to ``url`` by ``object_store.Upload``, in runs of every
    part of a run in parallel; then deleted."""
    from megatron_ext.engine import object_store

    view = memoryview(buffer.numpy()).cast("B")
    nbytes = len(view)
    run = object_store.CONCURRENCY * object_store.PART_BYTES
    t0 = time.perf_counter()
    upload = object_store.Upload(url, expected_size=nbytes)
    for offset in range(0, nbytes, run):
        upload.write_at(offset, view[offset:offset + run])
    upload.close(nbytes)
    seconds = time.perf_counter() - t0
    if object_store.size(url) != nbytes:
        raise RuntimeError(f"{url}: {object_store.size(url)} bytes on the server after uploading {nbytes}")
    object_store.delete([url])
    return {"client_alone_s": seconds, "client_alone_gbps": nbytes / seconds / 1e9}


def measure_datastates(state: dict, root: str, cache_gb: float | None, compute_s: float,
                       prefix: str = "datastates") -> dict:
    """One lazy save of ``state`` to the object-store root ``root`` while the caller computes
    ``compute_s``, then commit: blocked, snapshot, durable, the flush's GB/s (its telemetry record),
    as ``<prefix>_*``; the root removed after."""
    from megatron_ext.engine import CheckpointEngine, object_store

    nbytes = state_bytes(state)
    cache_gb = cache_gb if cache_gb is not None else max(nbytes / 2**30 * 1.02, 0.01)
    engine = CheckpointEngine({"save_dir": root, "host_cache_size": cache_gb}, rank=0, world_size=1)
    try:
        engine.cache.wait_allocated(600)  # a long-running trainer allocates once, long before
        t0 = time.perf_counter()
        engine.save(state, "step1")
        t_save = time.perf_counter() - t0
        busy_compute(compute_s)
        blocked_wait = engine.wait_snapshot()
        t_snapshot = time.perf_counter() - t0
        engine.commit("step1")
        engine.wait_persisted()
        t_persisted = time.perf_counter() - t0
        flush = next(r for r in engine.telemetry.records if r["event"] == "flush" and r["checkpoint"] == "step1")
        host_cache_bytes = engine.cache.nbytes
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    object_store.delete_tree(root)
    return {
        "host_cache_bytes": host_cache_bytes,
        f"{prefix}_save_call_s": t_save,
        f"{prefix}_blocking_s": t_save + blocked_wait,
        f"{prefix}_snapshot_s": t_snapshot,
        f"{prefix}_persisted_s": t_persisted,
        f"{prefix}_persisted_gbps": nbytes / t_persisted / 1e9,
        f"{prefix}_flush_s": flush["seconds"],
        f"{prefix}_flush_gbps": flush["gbps"],
    }


def measure_round(state: dict, buffer, rnd: int, modes, cache_gb: float | None, compute_s: float, server) -> dict:
    """Every mode once in the order ``modes``, the server's peak memory, and this round's ratio."""
    result: dict = {}
    with ServerRss(server.pid) as rss:
        for mode in modes:
            if mode == "client_alone":
                _progress(f"client alone: {state_bytes(state) / 1e9:.2f} GB through object_store.Upload")
                result.update(measure_client_alone(buffer, f"s3://{BUCKET}/client-alone-{rnd}.bin"))
            elif mode == "datastates":
                _progress("datastates: save, commit, until durable (nothing else running)")
                result.update(measure_datastates(state, f"s3://{BUCKET}/datastates-{rnd}", cache_gb, 0.0))
            elif mode == "datastates_training":
                _progress(f"datastates_training: save, compute {compute_s:g} s, commit, until durable")
                result.update(measure_datastates(state, f"s3://{BUCKET}/training-{rnd}", cache_gb, compute_s,
                                                 "datastates_training"))
            else:
                raise ValueError(f"unknown mode {mode!r}")
    result["server_peak_rss_bytes"] = rss.peak
    if "client_alone_gbps" in result and "datastates_flush_gbps" in result:
        result["ratio_flush_vs_client_alone"] = result["datastates_flush_gbps"] / result["client_alone_gbps"]
    return result


def server_version(binary: str) -> str:
    try:
        return subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def run(size_gb: float = 0.5, directory: str | None = None, cache_gb: float | None = None, compute_s: float = 1.0,
        repeats: int = DEFAULT_REPEATS, modes: tuple[str, ...] = MODES) -> dict:
    from megatron_ext.testing.s3_server import INSTALL_HINT, S3Server, S3ServerError, weed_binary

    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes must be among {', '.join(MODES)}, got {modes}")
    modes = [m for m in MODES if m in modes]
    from megatron_ext.engine import object_store

    result: dict = {"repeats": repeats, "compute_s": compute_s, "part_bytes": object_store.PART_BYTES,
                    "concurrency": object_store.CONCURRENCY,
                    "client_run_bytes": object_store.CONCURRENCY * object_store.PART_BYTES,
                    "load_average_before": list(os.getloadavg())}
    try:
        binary = weed_binary()
    except S3ServerError as exc:
        result.update({"skipped": {mode: f"{exc}" for mode in modes}, "server": None, "state_bytes": None,
                       "load_average_after": list(os.getloadavg())})
        _progress(f"skipped: no SeaweedFS server ({INSTALL_HINT})")
        return result
    result["server"] = server_version(binary)
    with working_dir(directory, "megatron-ext-bench-object-store-") as base:
        _progress(f"building a {size_gb} GB state")
        torch.manual_seed(0)
        state = make_state(int(size_gb * 1e9))
        buffer = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])  # the same bytes, one run
        result["state_bytes"] = state_bytes(state)
        with S3Server(os.path.join(base, "s3-server"), memory_limit_mb=SERVER_MEMORY_MB) as server:
            _progress(f"SeaweedFS on {server.endpoint} ({result['server']}), data in {server.store_dir}")
            server.create_bucket(BUCKET)
            with pointed_at(server):
                # Untimed: the bucket's first write makes its volume, and the server's first large
                # upload its buffers; neither would weigh on the first round's first mode only.
                measure_client_alone(buffer[:2 * object_store.CONCURRENCY * object_store.PART_BYTES],
                                     f"s3://{BUCKET}/warm-up.bin")
                rounds = []
                for rnd in range(repeats):
                    order = round_order(modes, rnd)
                    _progress(f"round {rnd + 1}/{repeats}: {', '.join(order)}")
                    rounds.append(measure_round(state, buffer, rnd, order, cache_gb, compute_s, server))
        result.update(figures_over_rounds(rounds))
        result["skipped"] = {}
        result["load_average_after"] = list(os.getloadavg())
        result["workdir"] = base
    return result


def format_table(r: dict) -> str:
    if r.get("state_bytes") is None:
        return "bench object-store skipped: " + "; ".join(f"{k}: {v}" for k, v in r["skipped"].items())
    r = collections.defaultdict(lambda: float("nan"), r)  # a mode not run (--modes) prints as nan
    return "\n".join([
        f"state {r['state_bytes'] / 1e9:.2f} GB to a local S3 server ({r['server']}); medians of {r['repeats']} "
        f"rounds (load average {r['load_average_before'][0]:.2f} before, {r['load_average_after'][0]:.2f} after)",
        f"  client alone  {r['client_alone_gbps']:.3f} GB/s (spread {r['client_alone_gbps_spread']:.3f}), "
        f"{r['part_bytes'] >> 20} MiB parts, {r['concurrency']} in flight",
        f"  datastates    flush {r['datastates_flush_gbps']:.3f} GB/s (spread {r['datastates_flush_gbps_spread']:.3f}), "
        f"durable {r['datastates_persisted_s']:.2f}s, nothing else running",
        f"  with training blocked {r['datastates_training_blocking_s']:.4f}s (save() "
        f"{r['datastates_training_save_call_s']:.4f}s) around {r['compute_s']:g} s of compute, durable "
        f"{r['datastates_training_persisted_s']:.2f}s, flush {r['datastates_training_flush_gbps']:.3f} GB/s "
        "(the server shares these cores with the compute)",
        f"  ratio         flush/client alone {r['ratio_flush_vs_client_alone']:.2f} (target >= 0.90); "
        f"server peak RSS {r['server_peak_rss_bytes'] / 1e6:.0f} MB",
    ])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench object-store``."""
    p.add_argument("--size-gb", type=POSITIVE, default=0.5, help="state size in GB (default 0.5)")
    p.add_argument("--cache-gb", type=POSITIVE, default=None, help="host cache in GiB (default: the state size)")
    p.add_argument("--compute-s", type=NONNEG, default=1.0,
                   help="seconds the caller computes between save and wait_snapshot (default 1)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help=f"rounds of every mode, order reversed every other; medians (default {DEFAULT_REPEATS})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (default both)")
    p.add_argument("--dir", default=None, help="where the server keeps its data (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    result = run(args.size_gb, args.dir, args.cache_gb, args.compute_s, args.repeats, tuple(args.modes))
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
