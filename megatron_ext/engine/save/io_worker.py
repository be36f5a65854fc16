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
snapshot thread; else at the first request) and gives each stage a
``channel``: the writer's, the stager's and the committer's run side by side, a socket and a
thread in the worker each. The worker executes ``io_ops.FileIo`` operations; an ``OSError``
there is raised again in the caller with the same errno and file name. The worker ends when the
engine closes the channels, or at end of file when the training process dies; it ignores
SIGINT and SIGTERM so that a final checkpoint (an exit signal handler, an interrupted run) still
reaches storage. ``LocalIo`` runs the same operations on the calling thread
(``flush_process: false``).

Messages: a 4-byte length and a JSON header ``{"op", "args", "payload"}`` followed by
``payload`` raw bytes (a sidecar, a report); the reply a 4-byte length and JSON ``{"ok",
"result"}`` or ``{"ok": false, "os_error" | "error"}``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

from ..errors import CheckpointError
from .io_ops import FileIo, IoError, os_error_fields, raise_os_error

_LEN = struct.Struct("<I")
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
    """What a stage calls; ``LocalIo`` and ``_Channel`` implement it."""

    def start_early(self) -> None:
        """Get ready for requests soon to come (the worker process started in the background)."""

    def run(self, file: int, offset: int, cache: int, nbytes: int, *, path: str | None = None,
            direct: bool = False, spans: list[int] | None = None) -> None:
        raise NotImplementedError

    def finish(self, file: int, size: int, sidecar_path: str, sidecar: bytes) -> dict:
        raise NotImplementedError

    def abort(self, file: int) -> None:
        raise NotImplementedError

    def atomic_write(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def stage(self, src: str, dst: str, direct: bool, expected: str | None, chunk_bytes: int) -> None:
        raise NotImplementedError


class LocalIo(IoChannel):
    """The operations on the calling thread (``flush_process: false``): one object for every channel."""

    def __init__(self, buffer: memoryview, overlap: bool | None = None):
        self._io = FileIo(buffer, overlap_checksums() if overlap is None else overlap)

    def channel(self, name: str) -> "LocalIo":
        return self

    def run(self, file, offset, cache, nbytes, *, path=None, direct=False, spans=None) -> None:
        self._io.run(file, offset, cache, nbytes, path=path, direct=direct, spans=spans)

    def finish(self, file, size, sidecar_path, sidecar) -> dict:
        return self._io.finish(file, size, sidecar_path, sidecar)

    def abort(self, file) -> None:
        self._io.abort(file)

    def atomic_write(self, path, data) -> None:
        self._io.atomic_write(path, data)

    def stage(self, src, dst, direct, expected, chunk_bytes) -> None:
        try:
            self._io.stage(src, dst, direct, expected, chunk_bytes)
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
        self._proc: subprocess.Popen | None = None
        self._channels = {name: _Channel(self, name) for name in CHANNELS}
        self._closed = False
        self._early: threading.Thread | None = None

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
            self._early = threading.Thread(target=self._start_quietly, name="datastates-io-start", daemon=True)
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
            pairs = {name: socket.socketpair() for name in CHANNELS}
            theirs = [pair[1] for pair in pairs.values()]
            # This process's import path, with this very copy of the package first; no ``site``
            # processing (``-S``, a third of the start-up): the path already holds what it adds.
            package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            paths = [package_root, *(p for p in sys.path if isinstance(p, str) and p and p != package_root)]
            boot = (f"import sys; sys.path[:0] = {paths!r}; "
                    "from megatron_ext.engine.save.io_worker import main; sys.exit(main())")
            cmd = [sys.executable, "-S", "-c", boot, "--cache-fd", str(self.cache_fd),
                   "--cache-bytes", str(self.cache_bytes),
                   *[f"--channel-fd={s.fileno()}" for s in theirs], *(["--overlap"] if self.overlap else [])]
            try:
                self._proc = subprocess.Popen(cmd, pass_fds=[self.cache_fd, *(s.fileno() for s in theirs)],
                                              stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                for pair in pairs.values():
                    pair[0].close()
                    pair[1].close()
                raise CheckpointError(f"the I/O worker process could not start ({exc}); set flush_process: false "
                                      "to flush from the training process instead") from exc
            finally:
                for s in theirs:
                    s.close()
            for name, pair in pairs.items():
                pair[0].settimeout(self.timeout_s)
                self._channels[name].sock = pair[0]

    def ended(self) -> str:
        """Why the worker stopped answering, for an error message."""
        proc = self._proc
        code = proc.poll() if proc is not None else None
        if code is None:
            return "the I/O worker process closed its channel"
        how = f"signal {-code}" if code < 0 else f"status {code}"
        return f"the I/O worker process (pid {proc.pid}) ended with {how}"

    def close(self, timeout: float = 10.0) -> None:
        """End the worker: its channels closed, it finishes what it has and exits (killed after ``timeout``)."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        for ch in self._channels.values():
            ch.close()
        if proc is not None and proc.poll() is None:
            # It exits on its own now (every request was answered): reaped in the background, not
            # waited for here (its interpreter's teardown would add tens of milliseconds to shutdown).
            try:
                threading.Thread(target=_reap, args=(proc, timeout), name="datastates-io-reaper", daemon=True).start()
            except RuntimeError:  # at interpreter exit (the exit hook's shutdown) no thread starts: reap here
                _reap(proc, timeout)


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Channel(IoChannel):
    """One stage's requests to the worker: one at a time, each answered before the next."""

    def __init__(self, worker: IoWorker, name: str):
        self.worker = worker
        self.name = name
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._buffer = bytearray()

    def start_early(self) -> None:
        self.worker.start_early()

    def run(self, file, offset, cache, nbytes, *, path=None, direct=False, spans=None) -> None:
        self._call("run", {"file": file, "offset": offset, "cache": cache, "nbytes": nbytes, "path": path,
                           "direct": direct, "spans": spans})

    def finish(self, file, size, sidecar_path, sidecar) -> dict:
        return self._call("finish", {"file": file, "size": size, "sidecar_path": sidecar_path}, sidecar)

    def abort(self, file) -> None:
        self._call("abort", {"file": file})

    def atomic_write(self, path, data) -> None:
        self._call("atomic_write", {"path": path}, data)

    def stage(self, src, dst, direct, expected, chunk_bytes) -> None:
        self._call("stage", {"src": src, "dst": dst, "direct": direct, "expected": expected,
                             "chunk_bytes": chunk_bytes})

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def _call(self, op: str, args: dict, payload: bytes = b"") -> Any:
        """One request and its reply: two system calls that release the GIL, whatever the work."""
        self.worker._started()
        with self._lock:
            sock = self.sock
            if sock is None:
                raise CheckpointError("the I/O worker was closed (the engine shut down)")
            header = json.dumps({"op": op, "args": args, "payload": len(payload)}, separators=(",", ":")).encode()
            try:
                sock.sendall(_LEN.pack(len(header)) + header + payload)
                reply = _receive(sock, self._buffer)
            except socket.timeout:
                raise CheckpointError(f"the I/O worker did not answer a {op} request within "
                                      f"{self.worker.timeout_s:.0f}s") from None
            except OSError as exc:
                raise CheckpointError(f"{self.worker.ended()} ({exc.strerror or exc})") from None
            if reply is None:
                raise CheckpointError(self.worker.ended())
        message = json.loads(reply)
        if message["ok"]:
            return message.get("result")
        if "os_error" in message:
            raise_os_error(message["os_error"])
        raise CheckpointError(message["error"])


def _receive(sock: socket.socket, buffer: bytearray) -> bytes | None:
    """One framed message from ``sock`` (usually in one ``recv``), None at end of file."""
    while True:
        if len(buffer) >= _LEN.size:
            (n,) = _LEN.unpack_from(buffer)
            if len(buffer) >= _LEN.size + n:
                message = bytes(buffer[_LEN.size:_LEN.size + n])
                del buffer[:_LEN.size + n]
                return message
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buffer += chunk


def _receive_exact(sock: socket.socket, buffer: bytearray, n: int) -> bytes | None:
    while len(buffer) < n:
        chunk = sock.recv(max(1 << 16, n - len(buffer)))
        if not chunk:
            return None
        buffer += chunk
    data = bytes(buffer[:n])
    del buffer[:n]
    return data


# ------------------------------------------------------------------------------------------ the worker
def _serve(io: FileIo, sock: socket.socket) -> None:
    """Answer one channel's requests until the training process closes it (or goes away)."""
    try:
        _answer(io, sock)
    except OSError:  # the training process is gone: nothing to answer
        pass
    finally:
        sock.close()


def _answer(io: FileIo, sock: socket.socket) -> None:
    buffer = bytearray()
    while True:
        header = _receive(sock, buffer)
        if header is None:
            return
        request = json.loads(header)
        payload = _receive_exact(sock, buffer, request["payload"]) if request["payload"] else b""
        if payload is None:
            return
        args = request["args"]
        try:
            op = request["op"]
            if op == "run":
                result = io.run(args["file"], args["offset"], args["cache"], args["nbytes"], path=args["path"],
                                direct=args["direct"], spans=args["spans"])
            elif op == "finish":
                result = io.finish(args["file"], args["size"], args["sidecar_path"], payload)
            elif op == "abort":
                result = io.abort(args["file"])
            elif op == "atomic_write":
                result = io.atomic_write(args["path"], payload)
            elif op == "stage":
                result = io.stage(args["src"], args["dst"], args["direct"], args["expected"], args["chunk_bytes"])
            else:
                raise IoError(f"unknown request {op!r}")
            reply = {"ok": True, "result": result}
        except OSError as exc:
            reply = {"ok": False, "os_error": os_error_fields(exc)}
        except Exception as exc:  # reaches the training process as a CheckpointError naming it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}" if not isinstance(exc, IoError) else str(exc)}
        data = json.dumps(reply, separators=(",", ":")).encode()
        sock.sendall(_LEN.pack(len(data)) + data)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-fd", type=int, required=True)
    p.add_argument("--cache-bytes", type=int, required=True)
    p.add_argument("--channel-fd", type=int, action="append", required=True)
    p.add_argument("--overlap", action="store_true",
                   help="checksum page-cache writes on a second thread too (O_DIRECT ones always are)")
    args = p.parse_args(argv)
    # The training process decides when the flush ends: an interrupt or a scheduler's SIGTERM to the
    # job must not stop the writes of the checkpoint it is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    memory = mmap.mmap(args.cache_fd, args.cache_bytes)
    threading.Thread(target=_map_pages, args=(memory,), name="datastates-io-map", daemon=True).start()
    io = FileIo(memoryview(memory), overlap=args.overlap)
    socks = [socket.socket(fileno=fd) for fd in args.channel_fd]
    threads = [threading.Thread(target=_serve, args=(io, s), name=f"datastates-io-{i}", daemon=True)
               for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    io.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
