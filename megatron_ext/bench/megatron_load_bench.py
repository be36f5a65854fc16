"""Megatron-LM's ``load_checkpoint``, datastates vs megatron-core ``torch_dist``: same state, same ranks, one run.

Measured through Megatron-LM's own ``pretrain_gpt.py`` (on CPU ranks, ``testing/megatron_lm.py``),
not the reference trainer: its ``load-checkpoint`` timer brackets exactly the call a user's job
makes at start-up (Megatron-LM's own ``torch_dist`` loader on one side, the patched route into
``megatron_ext.megatron.checkpointing`` on the other, with barriers on both ends) and it logs the
slowest rank's time. The reference trainer's torch_dist load is this project's re-implementation of
that path, so it would compare us with ourselves.

1. Two training runs with the same seed and flags write iteration ``ITERS`` once with
   ``--use-datastates`` and once with ``--ckpt-format torch_dist``. Megatron-LM's training is
   deterministic on CPU and both ways resume bit-identically (tests/megatron_lm), so the two
   checkpoints hold the same state; the recorded losses of the two runs are compared to show it.
2. ``repeats`` rounds, each loading both checkpoints (order alternating between rounds) in a fresh
   job with ``--load`` and ``--train-iters ITERS`` (nothing left to train), twice per checkpoint:
   **cold**, its pages evicted from the page cache first (a restart on another node, or long
   after the save: the bytes come from the disk), and **warm**, its files read once just before
   (the bytes come from memory: what each format costs on the CPU). The figures are medians over
   rounds; every run is reported.

3. In each round, the disk's limit for the same bytes: ``nproc`` processes started together, each
   reading its rank's tensor files of the datastates checkpoint cold, with no work on them, into
   reused buffers (read-ahead streams, 1 and ``READ_STREAMS`` per process; the faster counts).
   ``megatron_read_ceiling_s`` is its median; no loader of these bytes from this disk can beat it,
   so ``megatron_load_speedup_bound`` (torch_dist cold / ceiling) is the most any loader could
   show against torch_dist here, and ``megatron_load_vs_ceiling`` how close datastates comes.
   The same read (1 and ``READ_STREAMS`` streams) with the Adam moments' bytes landing in fresh
   memory, as a load must place them (its optimizer allocates them for the load: one first-touch
   fault per page, zeroed by the kernel), is ``megatron_fresh_read_ceiling_s``: the disk's limit plus the memory's, for these
   bytes, which ``megatron_load_speedup_fresh_bound`` turns into the most a loader that fills
   freshly allocated moments could show against torch_dist here.
4. In each round, one more job with the datastates checkpoint: right before ``load_checkpoint``
   each rank runs that fresh-pages read (``READ_STREAMS`` streams) of its own files, cold, inside
   the rank (``read_in_rank``, through the harness's ``--before-load``). The slowest rank's time,
   ``megatron_in_rank_read_s``, is the limit where and when a load runs: on the VMs this was
   measured on, the first read of a Megatron-LM rank took up to 2x the same read by the bench's
   spawned readers (docs/BENCHMARKS.md). ``megatron_load_vs_in_rank_read`` holds the cold load to it.

The default model (8 layers, hidden 1024, vocab 16384, bf16, distributed optimizer) makes a
1.65 GB checkpoint, 0.8 GB per rank, so that bytes rather than fixed costs dominate.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import multiprocessing
import os
import queue
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ext.bench.common import drop_page_cache, read_seconds
from megatron_ext.engine import read_manifest
from megatron_ext.engine.files import tree_bytes
from megatron_ext.engine.format.manifest import TensorIndex
from megatron_ext.procs import run_logged
from megatron_ext.testing import megatron_lm

ITERS = 2
MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
         "--lr-decay-iters", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "16384",
         "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
         "--bf16", "--use-distributed-optimizer",
         # The load-checkpoint timer goes to logger.info, which emerging-optimizers' absl hides at the pin
         # (the root logger at WARNING, docs/MEGATRON.md): the bench reads that line.
         "--logging-level", "20"]
FORMATS = {"datastates": ["--use-datastates", "--datastates-host-cache-size", "0.25"],
           "torch_dist": ["--ckpt-format", "torch_dist"]}
_TIMER = re.compile(r"load-checkpoint \.*: \(([\d.]+), ([\d.]+)\)")
_IN_RANK = re.compile(r"\[bench megatron-load\] rank (\d+) read its files cold in ([\d.]+)s")
RUN_TIMEOUT_S = 1200
READ_STREAMS = 4  # the engine's default restore_threads
#: Tensors a load allocates for itself (torch Adam's moments, by a part of their names): fresh pages.
MOMENTS = ("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")
CHUNK = 16 << 20


def _progress(msg: str) -> None:
    print(f"[bench megatron-load] {msg}", file=sys.stderr, flush=True)


def load_timer_s(log: str) -> float:
    """The slowest rank's ``load-checkpoint`` time from a Megatron-LM log, in seconds."""
    found = _TIMER.findall(log)
    if not found:
        raise RuntimeError("no load-checkpoint timer in the Megatron-LM log")
    return float(found[-1][1]) / 1000


def _environment() -> dict:
    """The runs' environment, bytecode kept as on a cluster (``PYTHONDONTWRITEBYTECODE`` dropped): an installed
    package is compiled at install time and a checkout on the first run, whereas compiling megatron_ext's
    modules at the first ``load_checkpoint`` would add about 0.2 s to its timer on these CPUs (torch_dist's
    modules are imported, with Megatron-LM's, before the timer starts)."""
    env = megatron_lm.environment()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(checkout: Path, nproc: int, args: list[str], workdir: str, name: str, record: str | None = None,
         before_load: str | None = None) -> str:
    log_path = os.path.join(workdir, f"{name}.log")
    cmd = megatron_lm.torchrun_command(nproc, args, checkout, record=record, before_load=before_load)
    code = run_logged(cmd, _environment(), log_path, RUN_TIMEOUT_S)
    with open(log_path, errors="replace") as f:
        log = f.read()
    if code != 0:
        tail = "\n".join(line for line in log.splitlines() if "....." not in line)[-4000:]
        raise RuntimeError(f"{name}: Megatron-LM exited with {code}\n$ {' '.join(cmd)}\n{tail}")
    return log


def measure(workdir: str, nproc: int = 2, repeats: int = 3, model: list[str] = MODEL,
            checkout: Path | None = None) -> dict:
    """Save once per format, then time ``repeats`` cold and warm loads of each; medians and every run."""
    if checkout is None:
        checkout, reason = megatron_lm.find_checkout()
        if checkout is None:
            return {"megatron_load_skipped": reason}
    os.makedirs(workdir, exist_ok=True)
    saved: dict[str, str] = {}
    losses: dict[str, list] = {}
    for fmt, flags in FORMATS.items():
        _progress(f"training {ITERS} iterations on {nproc} ranks and saving with {fmt}")
        saved[fmt] = os.path.join(workdir, f"ckpt-{fmt}")
        record = os.path.join(workdir, f"train-{fmt}.jsonl")
        if os.path.exists(record):
            os.unlink(record)
        _run(checkout, nproc, [*model, *flags, "--train-iters", str(ITERS), "--save", saved[fmt],
                               "--save-interval", str(ITERS)], workdir, f"train-{fmt}", record)
        losses[fmt] = [(r["iteration"], r["loss"], r["grad_norm"]) for r in megatron_lm.read_records(record)]
    seconds: dict[str, list[float]] = {f"{fmt}_{temp}": [] for fmt in FORMATS for temp in ("cold", "warm")}
    ceiling: list[float] = []
    fresh_ceiling: list[float] = []
    needed_ceiling: list[float] = []
    in_rank: list[float] = []

    def load_args(fmt: str) -> list[str]:
        """A job that loads ``saved[fmt]`` and trains nothing more."""
        # --use-datastates needs --save: a scratch directory, so nothing is written next to the checkpoint.
        extra = (["--save", os.path.join(workdir, "scratch"), "--save-interval", str(ITERS)]
                 if fmt == "datastates" else [])
        return [*model, *FORMATS[fmt], "--train-iters", str(ITERS), "--load", saved[fmt], *extra]

    for rep in range(repeats):
        _progress(f"round {rep + 1}/{repeats}: plain cold read of the datastates checkpoint's files by {nproc} processes")
        ceiling.append(min(plain_read_s(saved["datastates"], ITERS, nproc, streams) for streams in (1, READ_STREAMS)))
        fresh_ceiling.append(min(plain_read_s(saved["datastates"], ITERS, nproc, streams, fresh=MOMENTS)
                                 for streams in (1, READ_STREAMS)))
        needed_ceiling.append(min(plain_read_s(saved["datastates"], ITERS, nproc, streams, fresh=MOMENTS,
                                               replicas=True) for streams in (1, READ_STREAMS)))
        for fmt in (list(FORMATS) if rep % 2 == 0 else list(FORMATS)[::-1]):
            for temp in ("cold", "warm"):
                _progress(f"round {rep + 1}/{repeats}: Megatron-LM load_checkpoint of the {fmt} checkpoint ({temp})")
                drop_page_cache(saved[fmt])
                if temp == "warm":
                    read_tree(saved[fmt])
                log = _run(checkout, nproc, load_args(fmt), workdir, f"load-{fmt}-{temp}-{rep}")
                seconds[f"{fmt}_{temp}"].append(load_timer_s(log))
        _progress(f"round {rep + 1}/{repeats}: the fresh-pages read inside the Megatron-LM ranks, at their load")
        drop_page_cache(saved["datastates"])
        log = _run(checkout, nproc, load_args("datastates"), workdir, f"in-rank-read-{rep}", before_load=IN_RANK_HOOK)
        in_rank.append(in_rank_read_s(log, nproc))
    result = {
        "megatron_nproc": nproc,
        "megatron_ckpt_bytes_datastates": tree_bytes(saved["datastates"], skip_dirs=("datastates_telemetry",)),
        "megatron_ckpt_bytes_torch_dist": tree_bytes(saved["torch_dist"], skip_dirs=("datastates_telemetry",)),
        "megatron_same_training": losses["datastates"] == losses["torch_dist"] and bool(losses["datastates"]),
    }
    for key, runs in seconds.items():
        fmt, temp = key.rsplit("_", 1)
        suffix = "" if temp == "cold" else "_warm"
        result[f"megatron_load_s_{fmt}{suffix}"] = statistics.median(runs)
        result[f"megatron_load_s_{fmt}{suffix}_runs"] = runs
    result["megatron_load_speedup"] = result["megatron_load_s_torch_dist"] / result["megatron_load_s_datastates"]
    result["megatron_load_speedup_warm"] = (result["megatron_load_s_torch_dist_warm"]
                                            / result["megatron_load_s_datastates_warm"])
    result["megatron_read_ceiling_s"] = statistics.median(ceiling)
    result["megatron_read_ceiling_s_runs"] = ceiling
    result["megatron_load_vs_ceiling"] = result["megatron_read_ceiling_s"] / result["megatron_load_s_datastates"]
    result["megatron_load_speedup_bound"] = result["megatron_load_s_torch_dist"] / result["megatron_read_ceiling_s"]
    result["megatron_fresh_read_ceiling_s"] = statistics.median(fresh_ceiling)
    result["megatron_fresh_read_ceiling_s_runs"] = fresh_ceiling
    result["megatron_load_speedup_fresh_bound"] = (result["megatron_load_s_torch_dist"]
                                                   / result["megatron_fresh_read_ceiling_s"])
    result["megatron_load_vs_fresh_ceiling"] = (result["megatron_fresh_read_ceiling_s"]
                                                / result["megatron_load_s_datastates"])
    result["megatron_in_rank_read_s"] = statistics.median(in_rank)
    result["megatron_in_rank_read_s_runs"] = in_rank
    result["megatron_load_vs_in_rank_read"] = result["megatron_in_rank_read_s"] / result["megatron_load_s_datastates"]
    result["megatron_needed_read_ceiling_s"] = statistics.median(needed_ceiling)
    result["megatron_needed_read_ceiling_s_runs"] = needed_ceiling
    result["megatron_load_vs_needed_ceiling"] = (result["megatron_needed_read_ceiling_s"]
                                                 / result["megatron_load_s_datastates"])
    return result


def plain_read_s(root: str, iteration: int, nproc: int, streams: int, fresh: tuple[str, ...] = (),
                 replicas: bool = False) -> float:
    """Seconds for ``nproc`` processes, started together, to read cold each its rank's tensor files of
    checkpoint ``iteration`` under ``root`` (``streams`` read-ahead streams each, no work on the bytes).

    With ``fresh`` (parts of tensor names), the streams read only the tensors' bytes, those of tensors so
    named into one fresh anonymous mapping (first touched by the read), the others into reused buffers.
    With ``replicas`` each process also reads what its load needs from the other ranks' files: the
    model's shards written by another data-parallel rank of its (TP, PP) position (weights are
    replicated over data parallelism and written once, so every other rank reads them from there).
    """
    checkpoint = os.path.join(root, f"iter_{iteration:07d}")
    manifest = read_manifest(checkpoint)
    index = TensorIndex(checkpoint, manifest)
    per_rank = [_own_plans(root, manifest, index, r, fresh) for r in range(nproc)]
    if replicas:
        for r in range(nproc):
            per_rank[r] += [(os.path.join(root, e["tensor_file"]), _segments(_replicated(index.tensors(name)), fresh))
                            for name, e in manifest["files"].items() if _same_position(e, manifest["files"], r)]
    if fresh and not any(into_fresh for plans in per_rank for _, segs in plans for _, _, into_fresh in segs):
        raise RuntimeError(f"{checkpoint}: no tensor name holds {' or '.join(fresh)}: nothing would land in fresh memory")
    drop_page_cache(checkpoint)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(nproc), context.Queue()
    procs = [context.Process(target=_read_files, args=(plans, streams, bool(fresh), barrier, results))
             for plans in per_rank]
    for proc in procs:
        proc.start()
    took: list[float] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(took) < nproc:
            try:
                took.append(results.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"plain read of {checkpoint}: reader exit codes {dead or 'none (timeout)'}")
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return max(took)


def _own_plans(root: str, manifest: dict, index: TensorIndex, rank: int,
               fresh: tuple[str, ...]) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """What ``rank`` reads of its own tensor files: ``(path, segments)`` each (``_segments``)."""
    return [(os.path.join(root, e["tensor_file"]), _segments(index.tensors(name), fresh))
            for name, e in manifest["files"].items() if e["rank"] == rank]


#: ``--before-load`` hook of the harness (``megatron_lm``) that times the plain read inside the ranks.
IN_RANK_HOOK = f"{__name__}:read_in_rank"


def read_in_rank(args: Any) -> None:
    """On every rank, right before Megatron-LM's ``load_checkpoint``: the fresh-pages read of its own files.

    The same read as ``plain_read_s(..., READ_STREAMS, fresh=MOMENTS)``, cold (rank 0 evicts the
    files, a barrier on either side), but in the rank, as the first read of its memory, where and when
    the load runs. The bytes go nowhere; the files are evicted again before the load (not timed).
    """
    import torch.distributed as dist

    from megatron_ext.megatron.checkpoint_layout import read_tracker

    checkpoint = os.path.join(args.load, f"iter_{read_tracker(args.load):07d}")
    manifest = read_manifest(checkpoint)
    plans = _own_plans(args.load, manifest, TensorIndex(checkpoint, manifest), dist.get_rank(), MOMENTS)

    def evict() -> None:  # by rank 0, with no rank reading meanwhile
        dist.barrier()
        if dist.get_rank() == 0:
            drop_page_cache(checkpoint)
        dist.barrier()

    evict()
    start = time.perf_counter()
    _read_into_fresh(plans, READ_STREAMS)
    _progress(f"rank {dist.get_rank()} read its files cold in {time.perf_counter() - start:.4f}s")
    evict()


def in_rank_read_s(log: str, nproc: int) -> float:
    """The slowest rank's ``read_in_rank`` time, from a Megatron-LM log."""
    took = {int(rank): float(seconds) for rank, seconds in _IN_RANK.findall(log)}
    if sorted(took) != list(range(nproc)):
        raise RuntimeError(f"the Megatron-LM log has the in-rank read of ranks {sorted(took)}, not of all {nproc}")
    return max(took.values())


def _replicated(tensors: dict) -> dict:
    """The model's shards in a file (replicated over data parallelism; the optimizer's are not)."""
    return {name: meta for name, meta in tensors.items()
            if name.startswith("shards/tensors/") and ".optimizer." not in name and not name.startswith(
                "shards/tensors/optimizer.")}


def _same_position(entry: dict, files: dict, rank: int) -> bool:
    """``entry`` is another rank's file at ``rank``'s (TP, PP) position."""
    mine = [e["extra"]["layout"] for e in files.values() if e["rank"] == rank]
    if entry["rank"] == rank or not mine:
        return False
    theirs = entry["extra"]["layout"]
    return (theirs["tp_rank"], theirs["pp_rank"]) == (mine[0]["tp_rank"], mine[0]["pp_rank"])


def _segments(tensors: dict, fresh: tuple[str, ...]) -> list[tuple[int, int, bool]]:
    """A file's tensor bytes in file order, ``(begin, end, lands in fresh memory)``, neighbours merged."""
    merged: list[tuple[int, int, bool]] = []
    for name, meta in sorted(tensors.items(), key=lambda item: item[1]["offsets"][0]):
        begin, end = meta["offsets"]
        into_fresh = any(part in name for part in fresh)
        if merged and merged[-1][2] == into_fresh and merged[-1][1] == begin:
            merged[-1] = (merged[-1][0], end, into_fresh)
        else:
            merged.append((begin, end, into_fresh))
    return merged


def _read_files(plans: list[tuple[str, list[tuple[int, int, bool]]]], streams: int, fresh: bool,
                barrier: "multiprocessing.synchronize.Barrier", results: "multiprocessing.Queue") -> None:
    barrier.wait(RUN_TIMEOUT_S)
    start = time.perf_counter()
    if not fresh:
        for path, _ in plans:
            read_seconds(path, streams, direct=False)
    else:
        _read_into_fresh(plans, streams)
    results.put(time.perf_counter() - start)


def _private(nbytes: int) -> mmap.mmap:
    """New private anonymous memory, as a tensor's (``mmap.mmap(-1, n)`` alone is shared memory: shmem pages)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _read_into_fresh(plans: list[tuple[str, list[tuple[int, int, bool]]]], streams: int) -> None:
    """Read the planned bytes by ``streams`` threads, each a contiguous run of requests in file order
    on descriptors of its own; bytes marked fresh land in one new private anonymous mapping, the rest in
    each thread's reused buffer."""
    requests: list[tuple[str, int, int, int]] = []  # (path, file offset, length, place in fresh memory or -1)
    landed = 0
    for path, segments in plans:
        for begin, end, into_fresh in segments:
            for off in range(begin, end, CHUNK):
                n = min(CHUNK, end - off)
                requests.append((path, off, n, landed if into_fresh else -1))
                landed += n if into_fresh else 0
    target = memoryview(_private(max(1, landed)))
    per_stream = -(-sum(r[2] for r in requests) // streams)
    runs: list[list[tuple[str, int, int, int]]] = [[]]
    in_run = 0
    for request in requests:
        if in_run >= per_stream:
            runs.append([])
            in_run = 0
        runs[-1].append(request)
        in_run += request[2]

    def read(run: list[tuple[str, int, int, int]]) -> None:
        reused = memoryview(mmap.mmap(-1, CHUNK))
        fds: dict[str, int] = {}
        try:
            for path, off, n, place in run:
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fds[path], off, 0, os.POSIX_FADV_SEQUENTIAL)
                dest = target[place:place + n] if place >= 0 else reused[:n]
                if os.preadv(fds[path], [dest], off) != n:
                    raise OSError(f"short read of {path} at {off}")
        finally:
            for fd in fds.values():
                os.close(fd)

    with cf.ThreadPoolExecutor(len(runs)) as pool:
        for future in [pool.submit(read, run) for run in runs]:
            future.result(timeout=RUN_TIMEOUT_S)


def read_tree(root: str) -> None:
    """Read every file under ``root`` once, so that its pages are in the page cache."""
    buf = bytearray(16 << 20)
    for parent, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(parent, name), "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while f.readinto(buf):
                    pass
