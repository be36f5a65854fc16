"""The I/O worker process: the flush's checksums and writes, out of the training process.

On a GPU node the training thread is Python-bound, and every call of a background thread that
releases the GIL (a write, an fsync, one tensor's checksum update) makes it wait when the call
returns and the GIL is taken back (docs/ARCHITECTURE.md, "The GIL"). A checkpoint's flush makes
such calls by the dozen per file and one per tensor for the checksums. Here the training
process's stages send one request per run of cache slots, one per file and one per small file
to the worker, which reads the bytes from the host cache's shared memory (a memfd mapped by both)
and does the work with a GIL of its own: a run costs the training process one request and one
reply, whatever the number of tensors in it, as DCP's process executor and Megatron-LM's
persistent worker keep their writes out of the trainer.

``IoWorker`` (training process) starts the worker as the first copy begins (``start_early``, from the
snapshot thread; else at the first request) and gives each stage a ``channel``: the writer's, the
stager's and the committer's run side by side, a ``multiprocessing`` pipe and a thread in the
worker each. Requests and replies are the frozen dataclasses of ``io_ops``, pickled by the pipe;
both ends look a request's operation up in the one table ``io_ops.OPERATIONS``. An ``OSError`` in
the worker is raised again in the caller with the same errno and file name. The worker ends when
the engine closes the channels, or at end of file when the training process dies; it ignores
SIGINT and SIGTERM so that a final checkpoint (an exit signal handler, an interrupted run) still
reaches storage. ``LocalIo`` runs the same operations on the calling thread
(``flush_process: false``).

Start-up is multiprocessing's spawn (a fresh interpreter: no CUDA context, none of the trainer's
memory) with two things left out (``_WorkerPopen``): the training script is not run again as
``__mp_main__`` (a Megatron-LM script imports torch and megatron at its top) and no resource
tracker process is started (the worker makes no semaphores); the interpreter runs without ``site``
(``-S``, a third of its start), the trainer's import path given to it instead.
"""

from __future__ import annotations

import mmap
import multiprocessing.connection
import multiprocessing.util  # its exit hook (joining children) is registered before the engine's, so runs after it
import os
import signal
import socket
import struct
import sys
import threading
from io import BytesIO
from multiprocessing import context as mp_context, popen_spawn_posix, process, reduction, spawn
from typing import Any

from ...errors import CheckpointError
from ...format.digest import FileChecksums
from ...threads import EngineThread
from .io_ops import (AbortRequest, AtomicWriteRequest, Failure, FileIo, FinishRequest, IoError, RunRequest,
                     StageRequest, perform)

#: The stages that talk to the worker, each on its own channel (a request in flight each).
CHANNELS = ("writer", "stager", "committer")


#: Cores a rank needs to itself before a page-cache write and its checksum run side by side: the
#: training thread's, the copy's, the checksum's and the write's (an O_DIRECT write takes no core
#: while the device moves the bytes: its checksum always runs alongside, ``io_ops.FileIo``).
OVERLAP_CORES = 4


def cores_per_rank() -> int:
    """The cores this process may run on, shared by the ranks of its node (torchrun's LOCAL_WORLD_SIZE)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, cores // max(local, 1))


def overlap_checksums() -> bool:
    """Whether the worker checksums a page-cache write while writing it: only with ``OVERLAP_CORES`` cores per rank.
    Measured on two cores (docs/BENCHMARKS.md): the overlap doubled the training thread's time off
    the CPU, the checksum and the write each taking the core it waits for."""
    return cores_per_rank() >= OVERLAP_CORES


class IoChannel:
    """What a stage calls to have file operations done (``LocalIo`` here, ``_Channel`` in the worker).

    The calls, in the order a checkpoint makes them:

    1. ``start_early()`` as a copy begins (optional): the worker process starts meanwhile.
    2. Per tensor file, on the writer's channel: ``run`` once per run of cache slots, in file
       order, the first one naming the file's path and tensor spans (a first run again starts the
       file over); then ``finish``, which makes the file and its sidecar durable and returns their
       ``FileChecksums``. ``abort`` gives a file up at any point before ``finish``.
    3. Per durable file, with a node-local level, on the stager's channel: ``stage`` to the shared level.
    4. On the committer's channel: ``atomic_write`` of the rank report and the manifest.
    5. ``close`` of the owner (``IoWorker``, ``LocalIo``) once, at engine shutdown.

    A channel carries one request at a time; each call returns when its operation is done. Every
    call builds a request of ``io_ops`` and goes through ``call``, the one method an
    implementation provides.
    """

    #: The I/O worker process's id while it runs; None where the operations run in this process.
    worker_pid: int | None = None

    def start_early(self) -> None:
        """Get ready for requests soon to come (the worker process started in the background)."""

    def call(self, request: Any) -> Any:
        """``request`` done (``io_ops.OPERATIONS``): its reply; an ``OSError`` as raised, any other failure a ``CheckpointError``."""
        raise NotImplementedError

    def run(self, file: int, offset: int, cache: int, nbytes: int, *, path: str | None = None,
            direct: bool = False, spans: list[int] | None = None, size: int | None = None) -> None:
        self.call(RunRequest(file, offset, cache, nbytes, path, direct, None if spans is None else tuple(spans), size))

    def finish(self, file: int, size: int, sidecar_path: str, sidecar: bytes) -> FileChecksums:
        return self.call(FinishRequest(file, size, sidecar_path, bytes(sidecar)))

    def abort(self, file: int) -> None:
        self.call(AbortRequest(file))

    def atomic_write(self, path: str, data: bytes) -> None:
        self.call(AtomicWriteRequest(path, bytes(data)))

    def stage(self, src: str, dst: str, direct: bool, expected: str | None, chunk_bytes: int,
              cuts: list[int] | None = None) -> None:
        self.call(StageRequest(src, dst, direct, expected, chunk_bytes, None if cuts is None else tuple(cuts)))


class LocalIo(IoChannel):
    """The operations on the calling thread (``flush_process: false``): one object for every channel."""

    def __init__(self, buffer: memoryview, overlap: bool | None = None):
        self._io = FileIo(buffer, overlap_checksums() if overlap is None else overlap)

    def channel(self, name: str) -> "LocalIo":
        return self

    def call(self, request: Any) -> Any:
        try:
            return perform(self._io, request)
        except IoError as exc:
            raise CheckpointError(str(exc)) from None

    def close(self, timeout: float = 10.0) -> None:
        self._io.close()


class IoWorker:
    """The worker process over the host cache's memory ``cache_fd`` (``cache_bytes`` long),
    started as the first copy begins, or at the first request; ``timeout_s`` bounds every reply."""

    def __init__(self, cache_fd: int, cache_bytes: int, timeout_s: float, overlap: bool | None = None):
        self.cache_fd = cache_fd
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self.overlap = overlap_checksums() if overlap is None else overlap
        self._lock = threading.Lock()
        self._proc: _WorkerProcess | None = None
        self._channels = {name: _Channel(self, name) for name in CHANNELS}
        self._closed = False
        self._early: threading.Thread | None = None
        self._at_exit: multiprocessing.util.Finalize | None = None

    def channel(self, name: str) -> "_Channel":
        return self._channels[name]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start_early(self) -> None:
        """Start the worker on a thread of its own now, unless it runs: the snapshot thread calls this
        as a copy begins, so the process is up (and maps the cache) while the first run is copied."""
        if self._proc is not None or self._early is not None:  # the usual case, without the lock
            return
        with self._lock:
            if self._proc is not None or self._closed or self._early is not None:
                return
            self._early = EngineThread(self._start_quietly, "datastates-io-start")
            self._early.start()

    def _start_quietly(self) -> None:
        try:
            self._started()
        except CheckpointError:  # the first request starts it again and raises this to its stage
            pass

    def _started(self) -> None:
        """Start the worker unless it runs (any channel's first request does)."""
        with self._lock:
            if self._closed:
                raise CheckpointError("the I/O worker was closed (the engine shut down)")
            if self._proc is not None:
                return
            pipes = {name: multiprocessing.connection.Pipe(duplex=True) for name in CHANNELS}
            proc = _WorkerProcess(target=serve, name="datastates-io", daemon=True,
                                  args=(_InheritedFd(self.cache_fd), self.cache_bytes,
                                        [theirs for _, theirs in pipes.values()], self.overlap))
            try:
                proc.start()
            except Exception as exc:  # OSError, or a daemonic training process (it may have no children)
                for ours, _ in pipes.values():
                    ours.close()
                raise CheckpointError(f"the I/O worker process could not start ({exc}); set flush_process: false "
                                      "to flush from the training process instead") from exc
            finally:
                for _, theirs in pipes.values():
                    theirs.close()  # the worker's ends live in the worker only: its death is our end of file
            self._proc = proc
            for name, (ours, _) in pipes.items():
                _bound_waits(ours, self.timeout_s)
                self._channels[name].conn = ours
            # At interpreter exit multiprocessing joins its children after running its finalizers: an
            # engine never shut down still ends its worker (open channels would keep it waiting).
            self._at_exit = multiprocessing.util.Finalize(self, _close_channels, args=(list(self._channels.values()),),
                                                          exitpriority=10)

    def ended(self) -> str:
        """Why the worker stopped answering, for an error message."""
        proc = self._proc
        if proc is None:
            return "the I/O worker process closed its channel"
        proc.join(1.0)  # its pipes close as it exits, a moment before it can be reaped
        code = proc.exitcode
        if code is None:
            return "the I/O worker process closed its channel"
        how = f"signal {-code}" if code < 0 else f"status {code}"
        return f"the I/O worker process (pid {proc.pid}) ended with {how}"

    def close(self, timeout: float = 10.0) -> None:
        """End the worker: its channels closed, it finishes what it has and exits (killed after ``timeout``)."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
            at_exit, self._at_exit = self._at_exit, None
        if at_exit is not None:
            at_exit()  # closes the channels, and is off multiprocessing's list of finalizers
        for ch in self._channels.values():
            ch.close()
        if proc is not None and proc.exitcode is None:
            # It exits on its own now (every request was answered): waited for in the background, not
            # here (its interpreter's teardown would add tens of milliseconds to shutdown), and killed
            # if stuck (a hung file system), which multiprocessing's join at exit would wait on forever.
            try:
                EngineThread(_reap, "datastates-io-reaper", (proc, timeout)).start()
            except RuntimeError:  # at interpreter exit (the exit hook's shutdown) no thread starts: reap here
                _reap(proc, timeout)


def _close_channels(channels: list["_Channel"]) -> None:
    for ch in channels:
        ch.close()


def _reap(proc: "_WorkerProcess", timeout: float) -> None:
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


def _bound_waits(conn: multiprocessing.connection.Connection, timeout_s: float) -> None:
    """A send or receive on ``conn`` that waits ``timeout_s`` fails with ``BlockingIOError``
    (SO_SNDTIMEO, SO_RCVTIMEO): a hung worker is an error, not a hang, at no extra system call per message."""
    seconds = max(timeout_s, 0.001)
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    finally:
        sock.close()


class _Channel(IoChannel):
    """One stage's requests to the worker: one at a time, each answered before the next."""

    def __init__(self, worker: IoWorker, name: str):
        self.worker = worker
        self.name = name
        self.conn: multiprocessing.connection.Connection | None = None
        self._lock = threading.Lock()
        self._gone = "the I/O worker was closed (the engine shut down)"  # why ``conn`` is None once started

    @property
    def worker_pid(self) -> int | None:
        return self.worker.pid

    def start_early(self) -> None:
        self.worker.start_early()

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()

    def call(self, request: Any) -> Any:
        """One request and its reply: a write and two reads, whatever the work."""
        self.worker._started()
        with self._lock:
            conn = self.conn
            if conn is None:
                raise CheckpointError(self._gone)
            try:
                conn.send(request)
                reply = conn.recv()
            except BlockingIOError:  # SO_SNDTIMEO / SO_RCVTIMEO expired
                # Its late reply must not answer the next request: the channel is given up.
                self._gone = (f"the I/O worker did not answer a {request.op} request within "
                              f"{self.worker.timeout_s:.0f}s")
                self.close()
                raise CheckpointError(self._gone) from None
            except EOFError:
                raise CheckpointError(self.worker.ended()) from None
            except OSError as exc:
                raise CheckpointError(f"{self.worker.ended()} ({exc.strerror or exc})") from None
        if isinstance(reply, Failure):
            try:
                reply.raise_again()
            except IoError as exc:
                raise CheckpointError(str(exc)) from None
        return reply


# ------------------------------------------------------------------------------------- start-up
class _InheritedFd:
    """A file descriptor the worker inherits at spawn (multiprocessing's ``DupFd``): the cache's memfd."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _InheritedFd._arrived, (reduction.DupFd(self.fd),)

    @staticmethod
    def _arrived(dup) -> "_InheritedFd":
        return _InheritedFd(dup.detach())


class _WorkerPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn launch, with what the worker does not need left out: the training
    script's ``__main__`` (run again, it would import torch and megatron), the resource tracker
    process and ``site`` (the trainer's import path is handed over, this package's root first).

    Why a private override: multiprocessing's public API has no spawn that leaves ``__main__`` and
    the resource tracker out, and re-running a Megatron-LM script's imports costs seconds and a CUDA
    context per rank. The private pieces it leans on (``Popen._launch``, ``set_spawning_popen``,
    ``spawn_main(pipe_handle=)``, ``util._args_from_interpreter_flags``, ``util.spawnv_passfds``) are
    checked by tests/engine/test_io_worker.py, which fails when a Python release changes them."""

    def _launch(self, process_obj) -> None:
        # What ``spawn.prepare`` sets in the child before it unpickles the process: no main module
        # and no start method (asking for it would fix the trainer's default one for good).
        paths = [_PACKAGE_ROOT, *(process.ORIGINAL_DIR if p == "" else p for p in sys.path if isinstance(p, str))]
        prep = {"name": process_obj.name, "authkey": process.current_process().authkey,
                "sys_path": list(dict.fromkeys(paths)), "dir": os.getcwd(), "orig_dir": process.ORIGINAL_DIR}
        message = BytesIO()
        mp_context.set_spawning_popen(self)  # the DupFd of the arguments pass their fds through self._fds
        try:
            reduction.dump(prep, message)
            reduction.dump(process_obj, message)
        finally:
            mp_context.set_spawning_popen(None)
        child_r, parent_w = os.pipe()
        parent_r, child_w = os.pipe()  # the sentinel: readable once the worker is gone
        try:
            cmd = [spawn.get_executable(), *multiprocessing.util._args_from_interpreter_flags(), "-S", "-c",
                   f"from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle={child_r})",
                   "--multiprocessing-fork"]
            self.pid = multiprocessing.util.spawnv_passfds(spawn.get_executable(), cmd, [*self._fds, child_r, child_w])
            with open(parent_w, "wb", closefd=False) as out:
                out.write(message.getbuffer())
        except BaseException:
            os.close(parent_r)
            raise
        finally:
            os.close(parent_w)
            os.close(child_r)
            os.close(child_w)
        self.sentinel = parent_r
        self.finalizer = multiprocessing.util.Finalize(self, multiprocessing.util.close_fds, (parent_r,))


class _WorkerProcess(mp_context.SpawnProcess):
    """A spawn process started by ``_WorkerPopen``."""

    @staticmethod
    def _Popen(process_obj):
        return _WorkerPopen(process_obj)


#: The directory holding this copy of the package: first on the worker's import path.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["megatron_ext"].__file__)))


# ------------------------------------------------------------------------------------------ the worker
def _answer(file_io: FileIo, conn: multiprocessing.connection.Connection) -> None:
    """Answer one channel's requests until the training process closes it (or goes away)."""
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            try:
                reply = perform(file_io, request)
            except Exception as exc:  # reaches the training process as the same OSError, or a CheckpointError
                reply = Failure.of(exc)
            conn.send(reply)
    except OSError:  # the training process is gone: nothing to answer
        pass
    finally:
        conn.close()


#: madvise(2)'s MADV_POPULATE_READ (Linux 5.14; Python's mmap module does not name it).
_MADV_POPULATE_READ = 22


def _map_pages(memory: mmap.mmap) -> None:
    """Map every page of the cache into this process up front, in one call: the training process
    faulted them in already, so this only fills the page tables, which the first run's checksum
    and write would otherwise do a fault at a time, on the flush's path."""
    try:
        memory.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError):  # an older kernel: the pages are mapped as the runs touch them
        pass


def serve(cache: _InheritedFd, cache_bytes: int, conns: list, overlap: bool) -> None:
    """The worker process: map the cache, answer each channel on a thread of its own until all are closed.
    ``overlap``: checksum page-cache writes on a second thread too (O_DIRECT ones always are)."""
    # The training process decides when the flush ends: an interrupt or a scheduler's SIGTERM to the
    # job must not stop the writes of the checkpoint it is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.setsid()  # out of the job's process group: a terminal's interrupt is not meant for it
    except OSError:
        pass
    memory = mmap.mmap(cache.fd, cache_bytes)
    os.close(cache.fd)  # the mapping keeps the memory
    EngineThread(_map_pages, "datastates-io-map", (memory,)).start()
    file_io = FileIo(memoryview(memory), overlap=overlap)
    threads = [EngineThread(_answer, f"datastates-io-{i}", (file_io, conn))
               for i, conn in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    file_io.close()
