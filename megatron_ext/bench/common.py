"""Helpers shared by the benchmarks: physical limits (writes and reads), memory, a stand-in for compute,
the working directory, runs of the reference trainer and a one-process group."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil
import torch

from megatron_ext.engine.files import ChunkFile, supports_o_direct
from megatron_ext.procs import torchrun_command

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def make_state(total_bytes: int, tensor_bytes: int = 64 << 20, seed: int = 0) -> dict[str, torch.Tensor]:
    """A model-like state: fp32 and bf16 tensors of ``tensor_bytes`` each, ``total_bytes`` in all."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    remaining, i = total_bytes, 0
    while remaining > 0:
        n = min(tensor_bytes, remaining)
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        numel = max(1, n // torch.tensor([], dtype=dtype).element_size())
        state[f"layer{i:04d}.weight"] = torch.randn(numel, generator=gen).to(dtype)
        remaining -= numel * state[f"layer{i:04d}.weight"].element_size()
        i += 1
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def direct_write_gbps(directory: str, nbytes: int, chunk_bytes: int = 16 << 20, repeats: int = 2) -> float:
    """The physical limit: best of ``repeats`` single-thread O_DIRECT writes of ``nbytes``."""
    return max(_direct_write_once(directory, nbytes, chunk_bytes) for _ in range(repeats))


def _direct_write_once(directory: str, nbytes: int, chunk_bytes: int) -> float:
    path = os.path.join(directory, "direct-write-probe.bin")
    buf = mmap.mmap(-1, chunk_bytes)
    buf.write(os.urandom(1 << 20) * (chunk_bytes >> 20))
    view = memoryview(buf)
    start = time.perf_counter()
    f = ChunkFile(path, supports_o_direct(directory))
    offset = 0
    while offset < nbytes:
        f.write_at(offset, view)
        offset += chunk_bytes
    f.close(offset)
    elapsed = time.perf_counter() - start
    os.unlink(path)
    view.release()
    buf.close()
    return offset / elapsed / 1e9


def read_seconds(path: str, threads: int = 1, direct: bool = True, chunk_bytes: int = 16 << 20) -> float:
    """Seconds to read the whole of ``path`` by ``threads`` threads into reused buffers, ``chunk_bytes`` per request.

    ``direct``: ``O_DIRECT`` (buffered if the file system refuses), thread ``i`` reading every
    ``threads``-th chunk. Buffered: the file is cut into ``threads`` contiguous regions, each read
    front to back on a descriptor of its own advised ``POSIX_FADV_SEQUENTIAL`` (kernel read-ahead
    works per descriptor and stream). One thread = one sequential stream either way. The page
    cache is left as it is: the caller evicts the file first for a cold read.
    """
    size = os.path.getsize(path)
    buffers = [mmap.mmap(-1, chunk_bytes) for _ in range(threads)]
    per = -(-size // threads // chunk_bytes) * chunk_bytes  # region of each buffered stream
    start = time.perf_counter()
    shared = -1
    if direct:
        try:
            shared = os.open(path, os.O_RDONLY | _O_DIRECT)
        except OSError:
            shared = os.open(path, os.O_RDONLY)

    def reader(i: int) -> None:
        if direct:
            offsets = range(i * chunk_bytes, size, threads * chunk_bytes)
            fd = shared
        else:
            offsets = range(i * per, min(size, (i + 1) * per), chunk_bytes)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, i * per, per, os.POSIX_FADV_SEQUENTIAL)
        try:
            for offset in offsets:
                if os.preadv(fd, [buffers[i]], offset) <= 0:
                    raise OSError(f"short read of {path} at {offset}")
        finally:
            if fd != shared:
                os.close(fd)

    try:
        with cf.ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(reader, i) for i in range(threads)]:
                future.result(timeout=3600)
    finally:
        if shared >= 0:
            os.close(shared)
    elapsed = time.perf_counter() - start
    for buf in buffers:
        buf.close()
    return elapsed


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    return 4 * nbytes / (time.perf_counter() - start) / 1e9


class PeakRss:
    """Samples this process's resident memory on a thread; ``peak`` is the highest seen."""

    def __init__(self, interval_s: float = 0.01):
        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def busy_compute(seconds: float, size: int = 256) -> int:
    """Stand-in for forward/backward: matmuls on the calling thread for about ``seconds``.

    Uses one intra-op thread, like a GPU trainer whose CPU work is one thread launching kernels;
    the other core is left to the checkpoint threads, as the host's spare cores are on a GPU node.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _matmuls(seconds, size)
    finally:
        torch.set_num_threads(threads)


def _matmuls(seconds: float, size: int) -> int:
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    steps = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ b)
        steps += 1
    return steps


def drop_page_cache(directory: str) -> None:
    """Evict every file under ``directory`` from the page cache (clean pages go with DONTNEED), so the
    next read of them is cold (``/proc/sys/vm/drop_caches`` is not writable on these machines)."""
    for parent, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


@contextlib.contextmanager
def working_dir(given: str | None, prefix: str) -> Iterator[str]:
    """Where a benchmark writes: ``given`` (created if missing, and kept), else a new directory
    ``prefix*`` in the current one (``--dir``'s "a temporary directory here"), removed at the end,
    also when the benchmark fails."""
    if given:
        os.makedirs(given, exist_ok=True)
        yield given
        return
    made = tempfile.mkdtemp(prefix=prefix, dir=os.getcwd())
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def run_reference_trainer(nproc: int, args: list[str], log_json: str) -> list[dict]:
    """One torchrun of the reference trainer with ``args`` (model and run flags); its per-iteration records."""
    cmd = torchrun_command(nproc, "-m", "megatron_ext.testing.reference_trainer", *args, "--log-json", log_json)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    with open(log_json) as f:
        return [json.loads(line) for line in f]


def ensure_process_group(workdir: str, device: str = "cpu") -> None:
    """A world of this one process (gloo, plus NCCL for ``device="cuda"``) for DCP, unless one exists."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{os.path.join(os.path.abspath(workdir), 'pg-store')}",
                                rank=0, world_size=1)


#: Rounds every bench runs its modes in by default (docs/BENCHMARKS.md, Method): the machine's
#: speed drifts within minutes, so one pass of each mode says little.
DEFAULT_REPEATS = 3


def round_order(modes, rnd: int) -> list:
    """The order of ``modes`` in round ``rnd`` (from 0): as given in even rounds, reversed in odd ones,
    so that a drift of the machine weighs on every mode alike."""
    return list(modes) if rnd % 2 == 0 else list(modes)[::-1]


def figure_over_rounds(name: str, per_round: list) -> dict:
    """One figure measured once per round as ``{name: median, name_by_round: [...], name_spread: max - min}``.

    Rounds that have no value (None) are kept as None in ``_by_round`` and left out of the median
    and the spread (both None when no round has one)."""
    values = [v for v in per_round if v is not None]
    return {name: statistics.median(values) if values else None,
            f"{name}_by_round": list(per_round),
            f"{name}_spread": (max(values) - min(values)) if values else None}


def figures_over_rounds(rounds: list[dict], keys=None) -> dict:
    """Every numeric figure of per-round dicts (``keys``: those, default every number in the first
    round) through ``figure_over_rounds``; other values (text, flags) come from the first round."""
    out: dict = {}
    first = rounds[0]
    for key in (keys if keys is not None else first):
        value = first.get(key)
        if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))):
            out[key] = value
        else:
            out.update(figure_over_rounds(key, [r.get(key) for r in rounds]))
    return out
