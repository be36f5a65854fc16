"""``megatron-ext bench object-store``: the engine flushing to an S3 server against the S3 client alone, and
Megatron-LM's own ``--enable-msc`` save to it against ``--use-datastates``, in one run.

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

**Megatron-LM's own save to the same server** (issue 61): ``megatron_msc`` is a job of Megatron-LM's
``pretrain_gpt.py`` on CPU ranks (``megatron_e2e_bench.launch``: torchrun, the CPU harness, its model)
saving with ``--ckpt-format torch_dist --enable-msc --save msc://bench/<run>``, multi-storage-client
pointed at the server by a config file of the run (``MSC_CONFIG``; the admin identity of
``pointed_at``, read from the environment by MSC). ``megatron_datastates`` is the same job, same
model, seed and save interval, with ``--use-datastates --save s3://bench/<run>``. Why that pair and
not ``datastates`` against ``megatron_msc``: ``datastates`` saves one 0.5 GB synthetic state from
one process with nothing competing, while Megatron-LM's save writes its own model's tensors from
every rank while the other ranks train; only the same job on both sides compares the same bytes, the
same ranks and the same competition for the cores. Per save, both are timed the same way: from the
start of rank 0's ``save_checkpoint`` call until the checkpoint is durable on the server *and
counted* (Megatron-LM: its "successfully saved checkpoint" line, printed once the tracker is
written, for an async save by its finalize; the engine: rank 0's commit record, once its manifest is
written); the bytes are the objects of that ``iter_N`` on the server, so GB/s and the ratio to
``client_alone`` of the same round compare with the other modes'. Training blocked per save: the
save call (Megatron-LM's synchronous save waits in it for the upload) or, for the engine, ``save``
and the lazy wait before the optimizer step (its snapshot record). What the saves cost training
altogether, the wall seconds per iteration after the first save (``iter_s``, megatron-e2e's
timing): the engine's flush competes with the training ranks for the cores, Megatron-LM's
synchronous save stops them. Saves are spaced (``--megatron-save-interval``, default every 8
iterations) so that one is durable before the next starts: a save every iteration would time the
engine's queue, not a flush. The first save (the
engine's and MSC's clients and workers start) is left out.

Megatron-LM's setting: ``--msc-save sync`` (default), the one Megatron-LM documents for MSC
(megatron/core/MSC_Integration.md: ``--save msc://...``), through MSC's boto3 client; ``async`` adds
``--async-save --use-persistent-ckpt-worker --async-strategy mcore`` (it works with MSC; its worker
then uploads while training runs, so it blocks less and is durable later: docs/BENCHMARKS.md has one
run of each); ``--msc-rust-client`` switches MSC to its experimental Rust client. Where the checkout
or multi-storage-client is missing, or a job fails, ``<mode>_skipped`` (and ``skipped``) holds the
exact reason, and no figure of that mode is reported.

The modes alternate over ``--repeats`` rounds (reversed every other round); each figure is its
median over the rounds with ``_by_round`` and ``_spread`` (docs/BENCHMARKS.md, Method).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from megatron_ext.arg_types import NONNEG, POSITIVE, POSITIVE_INT, number
from megatron_ext.bench.common import (DEFAULT_REPEATS, busy_compute, figures_over_rounds, make_state, round_order,
                                       state_bytes, working_dir)

NAME = "object-store"
HELP = ("engine flushing to a local S3 server (SeaweedFS) vs the S3 client alone uploading the same bytes, and "
        "Megatron-LM's own --enable-msc torch_dist save to it vs --use-datastates")
#: The modes each round runs, in this order in even rounds and reversed in odd ones.
MODES = ("client_alone", "datastates", "datastates_training", "megatron_msc", "megatron_datastates")
#: The modes that are a job of Megatron-LM's own ``pretrain_gpt.py`` (``megatron_e2e_bench.launch``).
MEGATRON_MODES = ("megatron_msc", "megatron_datastates")
#: Megatron-LM's own save to the server through multi-storage-client: the settings ``--msc-save`` picks.
#: ``async`` is megatron-core's async strategy with its persistent worker (Megatron-LM switches
#: ``--async-save`` off without it; ``nvrx`` cannot run here, docs/BENCHMARKS.md, megatron-e2e).
MSC_SAVES = {"sync": ["--ckpt-format", "torch_dist", "--enable-msc"],
             "async": ["--ckpt-format", "torch_dist", "--enable-msc", "--async-save", "--use-persistent-ckpt-worker",
                       "--async-strategy", "mcore"]}
#: The MSC profile of the run's config file (``msc://<profile>/...``): the bench's bucket.
MSC_PROFILE = BUCKET = "bench"
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


# ---------------------------------------------------------------------------- Megatron-LM's own loop
@dataclasses.dataclass(frozen=True)
class MegatronJobs:
    """How the Megatron-LM modes run: the checkout, the model (``megatron_e2e_bench.MODELS``), the ranks,
    the iterations, a save every ``save_interval`` of them, the saves left out of the medians (the first
    ``warmup``), Megatron-LM's save setting (``MSC_SAVES``) and the MSC config file."""

    checkout: Path
    base: Path
    size: str = "default"
    nproc: int = 2
    iters: int = 40
    save_interval: int = 8
    warmup: int = 1
    msc_save: str = "sync"
    msc_config: Path | None = None


def msc_config(path: Path, endpoint: str, rust_client: bool = False) -> dict:
    """Write multi-storage-client's config for the server at ``endpoint`` (profile ``MSC_PROFILE``, the
    bucket ``BUCKET`` as its base path) to ``path`` and return it. The credentials are the admin
    identity ``pointed_at`` put in the environment, as references MSC expands (never written out).
    ``rust_client``: MSC's Rust client instead of boto3 (``allow_http``: the local server has no TLS)."""
    config = {"profiles": {MSC_PROFILE: {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                       "region_name": os.environ.get("AWS_REGION", "us-east-1")}},
        "credentials_provider": {"type": "S3Credentials", "options": {"access_key": "${AWS_ACCESS_KEY_ID}",
                                                                      "secret_key": "${AWS_SECRET_ACCESS_KEY}"}}}}}
    if rust_client:
        config["profiles"][MSC_PROFILE]["storage_provider"]["options"]["rust_client"] = {"allow_http": True}
    path.write_text(json.dumps(config, indent=1))
    return config


def megatron_missing(mode: str, checkout: Path | None, reason: str) -> str | None:
    """Why ``mode`` cannot run here (the exact exception line where an import fails), or None."""
    if checkout is None:
        return reason
    if mode == "megatron_msc":
        try:
            import multistorageclient  # noqa: F401  (Megatron-LM's --enable-msc refuses to start without it)
        except Exception as exc:  # the exact line, whatever the import raised
            return f"{type(exc).__name__}: {exc}"
    return None


#: Megatron-LM's line once the tracker names iteration N (an async save: printed by its finalize).
_SAVED = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] successfully saved checkpoint from iteration\s+(\d+) ")


def saved_moments(log: str) -> dict[int, float]:
    """Iteration -> the moment (seconds since the epoch) of Megatron-LM's "successfully saved checkpoint
    from iteration N" line: the tracker names N, the checkpoint counts (for an async save, its finalize)."""
    return {int(it): datetime.datetime.fromisoformat(when).timestamp() for when, it in _SAVED.findall(log)}


def _bytes_by_iteration(root: str) -> dict[int, int]:
    """The bytes on the server of each ``iter_NNNNNNN`` under the object-store root ``root``."""
    from megatron_ext.engine import object_store

    out: dict[int, int] = collections.Counter()
    for name, size in object_store.walk(root):
        head = name.split("/", 1)[0]
        if head.startswith("iter_") and head[5:].isdigit():
            out[int(head[5:])] += size
    return dict(out)


_RANK_ERROR = re.compile(r"^\[rank\d+\]: \w*(?:Error|Exception): .*")


def first_error(log_path: Path, limit: int = 600) -> str | None:
    """What a failed job died of: its log's first ``ERROR:`` line (a library's own report, e.g. the
    S3 request multi-storage-client gave up on), else the last exception line of a rank; None if neither."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    logged = [line for line in lines if line.startswith("ERROR:")]
    raised = [line for line in lines if _RANK_ERROR.match(line)]
    found = logged[0] if logged else (raised[-1] if raised else None)
    return found[:limit] if found else None


def measure_megatron(mode: str, jobs: MegatronJobs, rnd: int) -> dict:
    """One ``pretrain_gpt.py`` job saving to the server every ``save_interval`` (of ``jobs``) iterations, as
    ``<mode>_*``: per save
    (the medians of those after the first ``warmup``) the seconds from the start of rank 0's
    ``save_checkpoint`` call until the checkpoint is durable on the server and counted (Megatron-LM's
    tracker written, or the engine's manifest), its bytes on the server, their GB/s, the training
    thread's time blocked and in the save call; and the job's wall seconds per iteration after the
    first save (``iter_s``: each later save's cost to training in it); the job's objects removed after."""
    from megatron_ext.bench import megatron_e2e_bench
    from megatron_ext.engine import object_store
    from megatron_ext.testing import megatron_lm

    name = f"{mode}-{rnd}"
    run_dir = jobs.base / name
    env = megatron_lm.environment()
    if mode == "megatron_msc":
        root = f"s3://{BUCKET}/{name}"
        flags = [*MSC_SAVES[jobs.msc_save], "--save", f"msc://{MSC_PROFILE}/{name}"]
        env["MSC_CONFIG"] = str(jobs.msc_config)
    elif mode == "megatron_datastates":
        root = f"s3://{BUCKET}/{name}"
        telemetry = run_dir / "telemetry" / "rank-{rank}.jsonl"
        flags = ["--use-datastates", "--save", root, "--datastates-telemetry-path", str(telemetry)]
    else:
        raise ValueError(f"not a Megatron-LM mode: {mode!r}")
    args = [*megatron_e2e_bench.MODELS[jobs.size], "--train-iters", str(jobs.iters),
            "--save-interval", str(jobs.save_interval), *flags]
    try:
        try:
            log, calls = megatron_e2e_bench.launch(mode, run_dir, jobs.checkout, args, jobs.nproc, env)
        except RuntimeError as exc:
            cause = first_error(run_dir / "train.log")
            raise RuntimeError(f"{str(exc).splitlines()[0]}: {cause}" if cause else str(exc)) from None
        sizes = _bytes_by_iteration(root)
    finally:
        with contextlib.suppress(OSError):
            object_store.delete_tree(root)
    started = {c["iteration"]: c["started_at"] for c in calls}  # rank 0's save_checkpoint call began
    save_call = {c["iteration"]: c["wall_s"] for c in calls}
    if mode == "megatron_msc":
        durable = saved_moments(log)
        # sync: the upload is inside the call; async: the call schedules it (the finalize's checks at the
        # start of later iterations are not counted)
        blocked = save_call
    else:
        try:
            records = [json.loads(line) for line in
                       Path(str(telemetry).format(rank=0)).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise RuntimeError(f"{mode}: no telemetry of rank 0: {exc}") from None
        durable = {int(r["checkpoint"].removeprefix("iter_")): r["time"] for r in records if r["event"] == "commit"}
        # save() and the lazy wait before the optimizer step, as the engine counts them
        blocked = {int(r["checkpoint"].removeprefix("iter_")): r["blocked_s"] for r in records
                   if r["event"] == "snapshot"}
    saves = sorted(started)[jobs.warmup:]
    kept = [k for k in saves if k in durable and sizes.get(k)]
    if not kept:
        raise RuntimeError(f"{mode}: no save after the first {jobs.warmup} was found both started and durable on "
                           f"the server (log {run_dir / 'train.log'})")
    persisted = [durable[k] - started[k] for k in kept]
    # Iteration k's time holds iteration k - 1's save (megatron-e2e's timing): from the one after the
    # first save's, every later save's cost to training is in the mean.
    after = [t for k, (t, _) in megatron_e2e_bench.iteration_times(log).items() if k > min(started) + 1]
    return {
        f"{mode}_saves": len(kept),
        f"{mode}_ckpt_bytes": statistics.median(sizes[k] for k in kept),
        f"{mode}_persisted_s": statistics.median(persisted),
        f"{mode}_persisted_gbps": statistics.median(sizes[k] / s / 1e9 for k, s in zip(kept, persisted)),
        f"{mode}_blocking_s": statistics.median(blocked[k] for k in kept if k in blocked) if blocked else None,
        f"{mode}_save_call_s": statistics.median(save_call[k] for k in kept if k in save_call) if save_call else None,
        f"{mode}_iter_s": statistics.fmean(after) if after else None,
    }


def measure_round(state: dict, buffer, rnd: int, modes, cache_gb: float | None, compute_s: float, server,
                  jobs: MegatronJobs | None = None, skipped: dict | None = None) -> dict:
    """Every mode once in the order ``modes``, the server's peak memory, and this round's ratios. A
    Megatron-LM job that fails is named in ``skipped`` with the reason and left out of later rounds."""
    from megatron_ext.bench.megatron_e2e_bench import _failure

    skipped = {} if skipped is None else skipped
    result: dict = {}
    with ServerRss(server.pid) as rss:
        for mode in modes:
            if mode in skipped:
                continue
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
            elif mode in MEGATRON_MODES:
                _progress(f"{mode}: Megatron-LM's pretrain_gpt.py ({jobs.size} model, {jobs.nproc} CPU ranks), "
                          f"{jobs.iters} iterations, a save to the server every {jobs.save_interval}")
                try:
                    result.update(measure_megatron(mode, jobs, rnd))
                except RuntimeError as exc:
                    message = str(exc)
                    skipped[mode] = f"round {rnd + 1}: {_failure(message) if chr(10) in message else message}"
                    _progress(f"{mode} skipped: {skipped[mode]}")
            else:
                raise ValueError(f"unknown mode {mode!r}")
            # Untimed: the deleted objects' space back (SeaweedFS keeps it until a vacuum); the
            # server learns of a deletion seconds later, so this reclaims the previous mode's at least.
            try:
                server.vacuum()
            except OSError as exc:
                _progress(f"vacuum after {mode} failed (the disk keeps the deleted objects): {exc}")
    result["server_peak_rss_bytes"] = rss.peak
    if "client_alone_gbps" in result and "datastates_flush_gbps" in result:
        result["ratio_flush_vs_client_alone"] = result["datastates_flush_gbps"] / result["client_alone_gbps"]
    for mode in MEGATRON_MODES:
        if "client_alone_gbps" in result and f"{mode}_persisted_gbps" in result:
            result[f"ratio_{mode}_vs_client_alone"] = result[f"{mode}_persisted_gbps"] / result["client_alone_gbps"]
    if "megatron_msc_persisted_s" in result and "megatron_datastates_persisted_s" in result:
        result["speedup_megatron_datastates_vs_msc"] = (result["megatron_msc_persisted_s"]
                                                        / result["megatron_datastates_persisted_s"])
        if result["megatron_msc_iter_s"] and result["megatron_datastates_iter_s"]:
            result["ratio_megatron_datastates_vs_msc_iter_s"] = (result["megatron_datastates_iter_s"]
                                                                 / result["megatron_msc_iter_s"])
    return result


MEGATRON_TIMING = ("per save after the first: from the start of rank 0's save_checkpoint call for iteration N "
                   "until the checkpoint is durable on the server and counted: Megatron-LM's "
                   "'successfully saved checkpoint from iteration N' line (the tracker written; an async save's "
                   "finalize), the engine's commit record (its manifest written); bytes: the objects of iter_N "
                   "on the server")


def server_version(binary: str) -> str:
    try:
        return subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def run(size_gb: float = 0.5, directory: str | None = None, cache_gb: float | None = None, compute_s: float = 1.0,
        repeats: int = DEFAULT_REPEATS, modes: tuple[str, ...] = MODES, megatron_size: str = "default",
        megatron_iters: int = 40, megatron_save_interval: int = 8, megatron_nproc: int = 2,
        msc_save: str = "sync", msc_rust_client: bool = False) -> dict:
    from megatron_ext.testing.s3_server import INSTALL_HINT, S3Server, S3ServerError, weed_binary

    if not modes or set(modes) - set(MODES):
        raise ValueError(f"modes must be among {', '.join(MODES)}, got {modes}")
    if msc_save not in MSC_SAVES:
        raise ValueError(f"msc_save must be one of {', '.join(MSC_SAVES)}, got {msc_save!r}")
    modes = [m for m in MODES if m in modes]
    from megatron_ext.engine import object_store

    result: dict = {"repeats": repeats, "compute_s": compute_s, "part_bytes": object_store.PART_BYTES,
                    "concurrency": object_store.CONCURRENCY,
                    "client_run_bytes": object_store.CONCURRENCY * object_store.PART_BYTES,
                    "load_average_before": list(os.getloadavg())}
    megatron = [m for m in modes if m in MEGATRON_MODES]
    if megatron:
        result["megatron"] = {"size": megatron_size, "nproc": megatron_nproc, "iterations": megatron_iters,
                              "save_interval": megatron_save_interval, "warmup": 1, "msc_save": msc_save,
                              "msc_flags": " ".join(MSC_SAVES[msc_save]),
                              "msc_rust_client": msc_rust_client,
                              "timing": MEGATRON_TIMING}
    try:
        binary = weed_binary()
    except S3ServerError as exc:
        result.update({"skipped": {mode: f"{exc}" for mode in modes}, "server": None, "state_bytes": None,
                       "load_average_after": list(os.getloadavg())})
        result.update({f"{mode}_skipped": f"{exc}" for mode in megatron})
        _progress(f"skipped: no SeaweedFS server ({INSTALL_HINT})")
        return result
    result["server"] = server_version(binary)
    skipped: dict[str, str] = {}
    checkout = None
    if megatron:
        from megatron_ext.testing import megatron_lm

        checkout, reason = megatron_lm.find_checkout()
        for mode in megatron:
            why = megatron_missing(mode, checkout, reason)
            if why is not None:
                skipped[mode] = why
                _progress(f"{mode} skipped: {why}")
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
                jobs = None
                if checkout is not None:
                    config = Path(base) / "msc_config.json"
                    result["msc_config"] = msc_config(config, server.endpoint, msc_rust_client)
                    jobs = MegatronJobs(checkout, Path(base) / "megatron", megatron_size, megatron_nproc,
                                        megatron_iters, megatron_save_interval, 1, msc_save, config)
                # Untimed: the bucket's first write makes its volume, and the server's first large
                # upload its buffers; neither would weigh on the first round's first mode only.
                measure_client_alone(buffer[:2 * object_store.CONCURRENCY * object_store.PART_BYTES],
                                     f"s3://{BUCKET}/warm-up.bin")
                rounds = []
                for rnd in range(repeats):
                    order = round_order(modes, rnd)
                    _progress(f"round {rnd + 1}/{repeats}: {', '.join(order)}")
                    rounds.append(measure_round(state, buffer, rnd, order, cache_gb, compute_s, server, jobs,
                                                skipped))
        result.update(figures_over_rounds(rounds))
        result["skipped"] = skipped
        result.update({f"{mode}_skipped": skipped.get(mode) for mode in megatron})
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
        *_megatron_lines(r),
    ])


def _megatron_lines(r) -> list[str]:
    if "megatron" not in r:
        return []
    m = r["megatron"]
    lines = [f"  Megatron-LM pretrain_gpt.py, {m['size']} model, {m['nproc']} CPU ranks, {m['iterations']} "
             f"iterations, a save every {m['save_interval']} (the first left out):"]
    rust = ", MSC's Rust client" if m.get("msc_rust_client") else ""
    labels = {"megatron_msc": f"{m['msc_flags']} --save msc://{MSC_PROFILE}/...{rust}",
              "megatron_datastates": f"--use-datastates --save s3://{BUCKET}/..."}
    def num(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, (int, float)) and value == value else "-"

    for mode, label in labels.items():
        if r.get(f"{mode}_skipped"):
            lines.append(f"    {mode}: not run: {r[f'{mode}_skipped']}")
        elif isinstance(r.get(f"{mode}_persisted_s"), float):
            lines.append(f"    {mode:20s} {num(r[f'{mode}_ckpt_bytes'] / 1e6, '.0f')} MB durable in "
                         f"{num(r[f'{mode}_persisted_s'], '.2f')}s, {num(r[f'{mode}_persisted_gbps'], '.3f')} GB/s "
                         f"({num(r[f'ratio_{mode}_vs_client_alone'], '.2f')} of the client alone), blocked "
                         f"{num(r[f'{mode}_blocking_s'], '.4f')}s per save ({label})")
    for mode in labels:
        if isinstance(r.get(f"{mode}_iter_s"), float) and not r.get(f"{mode}_skipped"):
            lines.append(f"    {mode:20s} {r[f'{mode}_iter_s']:.3f} s per iteration, saves included")
    if isinstance(r.get("speedup_megatron_datastates_vs_msc"), float):
        lines.append(f"    datastates durable after {1 / r['speedup_megatron_datastates_vs_msc']:.2f}x the time of "
                     "Megatron-LM's --enable-msc save")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench object-store``."""
    p.add_argument("--size-gb", type=POSITIVE, default=0.5, help="state size in GB (default 0.5)")
    p.add_argument("--cache-gb", type=POSITIVE, default=None, help="host cache in GiB (default: the state size)")
    p.add_argument("--compute-s", type=NONNEG, default=1.0,
                   help="seconds the caller computes between save and wait_snapshot (default 1)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help=f"rounds of every mode, order reversed every other; medians (default {DEFAULT_REPEATS})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (default all)")
    p.add_argument("--megatron-size", choices=("default", "tiny"), default="default",
                   help="the Megatron-LM modes' model (bench megatron-e2e's): default ~150 MB of checkpoint per "
                        "rank, tiny the tests' GPT (default: default)")
    p.add_argument("--megatron-iters", type=number(int, 2), default=40,
                   help="iterations of each Megatron-LM job (default 40)")
    p.add_argument("--megatron-save-interval", type=POSITIVE_INT, default=8,
                   help="a save every this many iterations, long enough for one save to be durable before the "
                        "next (default 8); the first save is left out of the medians")
    p.add_argument("--megatron-nproc", type=POSITIVE_INT, default=2,
                   help="CPU ranks of each Megatron-LM job (default 2)")
    p.add_argument("--msc-save", choices=tuple(MSC_SAVES), default="sync",
                   help="megatron_msc: Megatron-LM's torch_dist save through multi-storage-client, synchronous or "
                        "--async-save with the persistent worker (default sync: see docs/BENCHMARKS.md)")
    p.add_argument("--msc-rust-client", action="store_true",
                   help="megatron_msc: multi-storage-client's experimental Rust client (`rust_client` in its config) "
                        "instead of its boto3 one")
    p.add_argument("--dir", default=None, help="where the server keeps its data (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    result = run(args.size_gb, args.dir, args.cache_gb, args.compute_s, args.repeats, tuple(args.modes),
                 args.megatron_size, args.megatron_iters, args.megatron_save_interval, args.megatron_nproc,
                 args.msc_save, args.msc_rust_client)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0
