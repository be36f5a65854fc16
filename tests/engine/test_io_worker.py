"""The I/O worker process (save/flow/io_worker.py) and the operations it runs (save/flow/io_ops.py).

The worker checksums and writes what the training process put in the shared host cache. What it
must get right: the same bytes and checksums as before, with or without the overlap of checksum
and write; a request count per checkpoint that does not grow with the number of tensors (the
point of it: each request is a GIL switch for the training thread); its failures reaching the
training thread as errors (an ``OSError`` with its errno and file, its death, a missing reply);
and its life bound to the engine's: started at the first write, ended at shutdown or when the
training process dies, deaf to SIGINT and SIGTERM in between.
"""

from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import xxhash

from megatron_ext.engine import CheckpointEngine, CheckpointError, open_committed, read_manifest
from megatron_ext.engine.files import supports_o_direct
from megatron_ext.engine.format.digest import combine
from megatron_ext.engine.save.flow.io_ops import OPERATIONS, FileIo
from megatron_ext.engine.save.flow.io_worker import IoWorker, LocalIo

from helpers.procs import alive, child_env, wait_until
from helpers.states import FAST, TINY, assert_same, committed_names, seeded_state


def test_the_private_multiprocessing_pieces_the_worker_start_leans_on_are_as_it_expects():
    """``io_worker._WorkerPopen`` overrides spawn's launch (its docstring says why): a Python release
    that renames or reshapes one of these pieces fails here, not as a worker that never starts."""
    import inspect
    from multiprocessing import context as mp_context, popen_spawn_posix, spawn, util

    assert list(inspect.signature(popen_spawn_posix.Popen._launch).parameters) == ["self", "process_obj"]
    assert "self._fds" in inspect.getsource(popen_spawn_posix.Popen)  # the fds a DupFd passes to the child
    assert callable(mp_context.set_spawning_popen) and callable(util.spawnv_passfds)
    assert "pipe_handle" in inspect.signature(spawn.spawn_main).parameters
    assert isinstance(util._args_from_interpreter_flags(), list)
    prepare = inspect.getsource(spawn.prepare)  # the keys _launch hands the child, as the child reads them
    assert all(f"'{key}' in data" in prepare for key in ("name", "authkey", "sys_path", "dir", "orig_dir"))


@pytest.mark.parametrize("direct", [False, True], ids=["page_cache", "o_direct"])
@pytest.mark.parametrize("overlap", [True, False])
def test_runs_give_the_file_and_its_checksums_with_or_without_overlap(tmp_path, overlap, direct):
    """Three runs over four tensors (one split across runs, one empty): the file's bytes, the
    file's (of its pieces'), per-tensor and sidecar checksums are what hashing the bytes directly gives. An
    O_DIRECT run is checksummed on the second thread whatever ``overlap`` says (the write takes no
    core); a page-cache one only with ``overlap``."""
    if direct and not supports_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    data = bytes(range(256)) * 64  # 16 KiB of file: header-less, tensors back to back
    spans = [0, 5000, 5000, 5000, 5000, 12000, 12000, 16384]
    memory = mmap.mmap(-1, 3 * 8192)
    io = FileIo(memoryview(memory), overlap=overlap)
    path = str(tmp_path / "f.safetensors")
    sidecar = b'{"state": 1}'
    try:
        # The runs sit in the cache in another order than in the file (slots are where they were free).
        for i, (offset, slot) in enumerate(((0, 2), (8192, 0))):
            n = min(8192, len(data) - offset)
            memory[slot * 8192:slot * 8192 + n] = data[offset:offset + n]
            io.run(7, offset, slot * 8192, n, **({"path": path, "direct": direct, "spans": spans} if i == 0 else {}))
        sums = io.finish(7, len(data), str(tmp_path / "f.state.json"), sidecar)
        hashed_aside = any(t.name.startswith("datastates-io-checksum") for t in threading.enumerate())
    finally:
        io.close()
    assert hashed_aside == (overlap or direct)
    assert (tmp_path / "f.safetensors").read_bytes() == data
    assert (tmp_path / "f.state.json").read_bytes() == sidecar
    pieces = [(a, b) for a, b in zip(spans[::2], spans[1::2]) if b > a]  # format 3: the file's digest of its pieces'
    assert sums.file == combine(xxhash.xxh3_64_intdigest(data[a:b]) for a, b in pieces)
    assert sums.tensors == tuple(xxhash.xxh3_64_hexdigest(data[a:b]) for a, b in zip(spans[::2], spans[1::2]))
    assert sums.sidecar == xxhash.xxh3_64_hexdigest(sidecar)


def test_the_worker_starts_at_the_first_save_and_ends_at_shutdown(tmp_path):
    engine = CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST})
    try:
        worker = engine.pipeline.io
        assert isinstance(worker, IoWorker) and worker.pid is None  # nothing saved: no process
        engine.save(seeded_state(1, 5000, (10, 10)), "A", version=1)
        engine.commit("A")
        engine.wait_persisted()
        pid = worker.pid
        assert pid is not None and alive(pid)
    finally:
        engine.shutdown()
    wait_until(lambda: not alive(pid), "the worker ends with the engine", timeout=20)
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **FAST}, read_only=True) as reader:
        assert_same(reader.load("A"), seeded_state(1, 5000, (10, 10)))
        assert reader.pipeline.io.pid is None  # reading starts no worker


def _os_thread_names(pid: int | str = "self") -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_engine_threads_carry_their_names_in_the_os(tmp_path):
    """``top -H``, perf and ``bench train``'s CPU account tell the engine's threads apart by their OS
    names: the snapshot copy, the writer and the committer here, the checksum and the channels in
    the I/O worker; the training thread keeps its own name."""
    before = threading.current_thread().native_id
    with open(f"/proc/self/task/{before}/comm") as f:
        own = f.read().strip()
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST}) as engine:
        engine.save(seeded_state(1, 5000, (10, 10)), "A", version=1)
        engine.commit("A")
        engine.wait_persisted()
        ours = _os_thread_names()
        theirs = _os_thread_names(engine.pipeline.io.pid)
    assert {"ds-snapshot", "ds-committer"} <= set(ours), ours
    assert {"ds-io-0", "ds-io-1", "ds-io-2"} <= set(theirs), theirs
    if supports_o_direct(str(tmp_path)):  # the checksum thread runs beside an O_DIRECT write
        assert "ds-io-checksum" in theirs, theirs
    with open(f"/proc/self/task/{before}/comm") as f:
        assert f.read().strip() == own


def test_requests_per_checkpoint_do_not_grow_with_the_number_of_tensors(tmp_path):
    """Each request costs the training thread a GIL switch: a checkpoint of 300 tensors makes as
    many as one of 3 (one per run of cache slots, one per file, one per report and manifest)."""
    def requests(count: int) -> dict:
        calls: dict[str, int] = {}
        with CheckpointEngine({"save_dir": str(tmp_path / f"n{count}"), "host_cache_size": 0.05, **FAST}) as engine:
            for name in ("writer", "committer"):
                channel = engine.pipeline.io.channel(name)
                call = channel.call

                def counted(request, call=call):
                    calls[request.op] = calls.get(request.op, 0) + 1
                    return call(request)

                channel.call = counted
            state = {f"t{i}": torch.full((2000,), float(i)) for i in range(count)}
            engine.save(state, "A", version=1)
            engine.commit("A")
            engine.wait_persisted()
            assert_same(engine.load("A"), state)
        return calls

    few, many = requests(3), requests(300)
    assert few == many == {"run": 1, "finish": 1, "atomic_write": 2}


def test_an_os_error_in_the_worker_reaches_the_caller_with_its_errno_and_file(tmp_path):
    engine = CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST})
    try:
        # A directory where the tensor file goes: the worker's open fails with EISDIR.
        target = tmp_path / "ckpt" / "A" / f"rank00000.{engine.run_id}.safetensors"
        target.mkdir(parents=True)
        engine.save(seeded_state(1, 5000, (10, 10)), "A", version=1)
        with pytest.raises(CheckpointError) as info:
            engine.wait_persisted()
        cause = info.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.EISDIR and cause.filename == str(target)
    finally:
        with pytest.raises(CheckpointError):
            engine.shutdown(timeout=10)


def test_a_killed_worker_fails_the_checkpoint_on_the_training_thread(tmp_path):
    root = tmp_path / "ckpt"
    engine = CheckpointEngine({"save_dir": str(root), **TINY, **FAST})
    try:
        engine.save(seeded_state(1, 5000, (10, 10)), "A", version=1)
        engine.commit("A")
        engine.wait_persisted()
        os.kill(engine.pipeline.io.pid, signal.SIGKILL)
        wait_until(lambda: engine.pipeline.io._proc.exitcode is not None, "the worker is gone", timeout=20)
        engine.save(seeded_state(2, 5000, (10, 10)), "B", version=2)
        # The writer may meet the dead worker before commit() is called (then commit raises) or after.
        with pytest.raises(CheckpointError, match="I/O worker process .* ended with signal 9"):
            engine.commit("B")
            engine.wait_persisted()
    finally:
        with pytest.raises(CheckpointError):
            engine.shutdown(timeout=10)
    assert committed_names(root) == ["A"]
    assert read_manifest(str(root / "B")) is None


def test_the_worker_ignores_sigint_and_sigterm(tmp_path):
    """An interrupt or a scheduler's SIGTERM reaches the whole job: the training process may still
    be saving its last checkpoint, which the worker must write."""
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST}) as engine:
        engine.save(seeded_state(1, 5000, (10, 10)), "A", version=1)
        engine.commit("A")
        engine.wait_persisted()
        pid = engine.pipeline.io.pid
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        engine.save(seeded_state(2, 5000, (10, 10)), "B", version=2)
        engine.commit("B")
        engine.wait_persisted()
        assert engine.pipeline.io.pid == pid and alive(pid)
        assert_same(engine.load("B"), seeded_state(2, 5000, (10, 10)))


_ORPHAN = """
import os, signal, sys, torch
from megatron_ext.engine import CheckpointEngine
e = CheckpointEngine({"save_dir": sys.argv[1], "host_cache_size": 0.01})
e.save({"x": torch.ones(1000)}, "A", version=1); e.commit("A"); e.wait_persisted()
print(e.pipeline.io.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_worker_ends_when_the_training_process_is_killed(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _ORPHAN, str(tmp_path / "ckpt")], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pid = int(proc.stdout.split()[-1])
    wait_until(lambda: not alive(pid), "the orphaned worker exits", timeout=20)


def test_without_the_worker_process_the_same_files_are_written(tmp_path):
    """``flush_process: false``: the operations on the engine's own threads, the same checkpoint."""
    state = seeded_state(3, 20_000, (30, 40))
    names: dict = {}
    for mode in (True, False):
        root = tmp_path / f"p{mode}"
        with CheckpointEngine({"save_dir": str(root), **TINY, **FAST, "flush_process": mode}) as engine:
            engine.save(state, "A", version=1)
            engine.commit("A")
            engine.wait_persisted()
            io = engine.pipeline.io
            assert isinstance(io, IoWorker) and io.pid is not None if mode else isinstance(io, LocalIo)
            assert_same(engine.load("A"), state)
            tensors = open_committed(str(root), "A").tensors("rank00000")
            names[mode] = {name: (t.begin, t.end, t.checksum) for name, t in tensors.items()}
    assert names[True] == names[False]  # the files differ only in their run ids


@pytest.fixture
def shared_cache():
    """A memfd the size of a small host cache, as ``host_cache.HostCache`` makes it (its first byte 7)."""
    fd = os.memfd_create("test-io-cache", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 20)
    os.pwrite(fd, b"\x07", 0)
    yield fd
    os.close(fd)


def test_an_operation_added_to_the_table_is_reachable_in_process_and_in_the_worker(shared_cache):
    """A request class and a row in ``io_ops.OPERATIONS`` are all an operation needs: ``LocalIo``
    runs it on the calling thread, the worker process in its own (which reads the same cache memory
    and, though this process imported torch, imports none)."""
    from helpers import extra_io_op

    try:
        memory = mmap.mmap(shared_cache, 1 << 20)
        local = LocalIo(memoryview(memory))
        here = local.call(extra_io_op.WhereRequest(0))
        assert here == extra_io_op.WhereReply(os.getpid(), 7, True)
        worker = IoWorker(shared_cache, 1 << 20, timeout_s=30)
        try:
            for name in ("writer", "stager", "committer"):
                there = worker.channel(name).call(extra_io_op.WhereRequest(0))
                assert there == extra_io_op.WhereReply(worker.pid, 7, False)
        finally:
            worker.close()
            local.close()
    finally:
        del OPERATIONS[extra_io_op.WhereRequest.op]
        sys.modules.pop("helpers.extra_io_op", None)


def test_a_request_outside_the_table_is_refused_by_both_paths(shared_cache):
    from helpers.extra_io_op import UnknownRequest

    memory = mmap.mmap(shared_cache, 1 << 20)
    worker = IoWorker(shared_cache, 1 << 20, timeout_s=30)
    try:
        for io in (LocalIo(memoryview(memory)), worker.channel("writer")):
            with pytest.raises(CheckpointError, match="unknown request 'not_an_operation'"):
                io.call(UnknownRequest())
        worker.channel("writer").abort(1)  # the channel still answers
    finally:
        worker.close()


def test_a_dead_worker_is_an_error_at_once_and_a_silent_one_after_the_timeout(shared_cache):
    """Never a hang: a killed worker fails the next request with how it ended; a stopped one (a hung
    file system) fails it once ``timeout_s`` has passed."""
    worker = IoWorker(shared_cache, 1 << 20, timeout_s=2)
    try:
        worker.channel("writer").abort(1)
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="did not answer a abort request within 2s"):
            worker.channel("committer").abort(1)
        assert 1.5 < time.monotonic() - started < 10
        os.kill(worker.pid, signal.SIGCONT)  # its late reply must not answer the channel's next request
        with pytest.raises(CheckpointError, match="did not answer a abort request"):
            worker.channel("committer").stage("/nonexistent", "/nonexistent.copy", False, None, 4096)
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"I/O worker process \(pid \d+\) ended with signal 9"):
            worker.channel("stager").abort(1)
        assert time.monotonic() - started < 5
    finally:
        worker.close(timeout=1)


_MAIN = """
import os, sys
open(os.environ["TRAIN_MARKS"], "a").write(f"{os.getpid()}\\n")  # a training script's top level: the trainer only
from megatron_ext.engine.save.flow.io_worker import IoWorker
if __name__ == "__main__":
    fd = os.memfd_create("cache"); os.ftruncate(fd, 4096)
    worker = IoWorker(fd, 4096, timeout_s=30)
    worker.channel("writer").abort(1)
    print(os.getpid(), worker.pid, flush=True)
    worker.close()
"""


def test_the_worker_does_not_run_the_training_script_again(tmp_path):
    """multiprocessing's spawn would run the script's top level again as ``__mp_main__`` (for a
    Megatron-LM script: torch and megatron imported, seconds and hundreds of MB); the worker's does not."""
    script = tmp_path / "train.py"
    script.write_text(_MAIN)
    marks = tmp_path / "ran"
    proc = subprocess.run([sys.executable, str(script)], env=child_env(TRAIN_MARKS=str(marks)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer, worker = proc.stdout.split()
    assert worker != trainer and marks.read_text().split() == [trainer]


_LEFT_RUNNING = """
import os
from megatron_ext.engine.save.flow.io_worker import IoWorker
fd = os.memfd_create("cache"); os.ftruncate(fd, 4096)
worker = IoWorker(fd, 4096, timeout_s=30)
worker.channel("writer").abort(1)
print(worker.pid, flush=True)
"""


def test_a_worker_never_closed_does_not_hold_the_interpreter_at_exit(tmp_path):
    """multiprocessing joins its children at exit, and the worker waits for its channels to close:
    its finalizer closes them first."""
    proc = subprocess.run([sys.executable, "-c", _LEFT_RUNNING], env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not alive(int(proc.stdout.split()[-1]))
