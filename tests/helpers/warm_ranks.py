"""Rank processes forked from a warm parent: torchrun's one-node launch without a cold interpreter per rank.

A cold rank of Megatron-LM's loop spends 13-17 s of CPU importing torch, megatron-core and
megatron.training before its first instruction (2-core VM, 2026-12-02; docs/TESTING.md), and the
default test run starts hundreds of ranks. Here a *zygote* per test session imports them once,
and each job's ranks are forked from it: one for torch, megatron-core and the patched Megatron-LM,
one for DeepSpeed (a job whose module or script names DeepSpeed), whose import picks its
accelerator and sets the environment the other ranks must not inherit.

    python tests/helpers/warm_ranks.py serve DIR megatron [CHECKOUT]        a zygote (tests/conftest.py)
    python tests/helpers/warm_ranks.py serve DIR deepspeed
    python tests/helpers/warm_ranks.py launch --nnodes 1 --nproc-per-node N
        --master-addr ADDR --master-port PORT (-m MODULE | SCRIPT) ARGS...  a drop-in for torchrun
    python tests/helpers/warm_ranks.py run (-m MODULE | -c CODE | SCRIPT) ARGS...  a drop-in for python

``launch`` takes the one-node subset of torchrun's command line that ``megatron_ext.procs`` builds
(``helpers.procs.torchrun_command`` swaps the module when a zygote runs); ``run`` one interpreter,
as the command line tools the tests call are (``helpers.procs.python_command``). Anything they
cannot serve warm (no zygote, another command line, an environment the zygote's imports would have
read differently, a GPU) runs the real torchrun or interpreter instead, with the same arguments.

What a warm rank keeps of a cold one, and how:

* torchrun's job: every rank in a session of its own with torchrun's environment (``RANK``,
  ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_USE_AGENT_STORE=True``, ...); the job's TCPStore hosted by
  the job's supervisor (torchrun's agent hosts it, so it outlives any rank); the first rank to fail
  makes the supervisor SIGTERM the others, wait 30 s and SIGKILL them, and the job exits 1; a
  SIGTERM, SIGINT, SIGHUP or SIGQUIT to the launcher goes to every rank, as torchrun forwards it
  (the same grace, then exit code 128 + the signal's number);
  a launcher killed outright takes its ranks with it (its socket closes; they get SIGKILL).
* ``run``'s: the one process's exit code, or its death by a signal, which the launcher then dies
  of too; a signal to the launcher goes to the process, which decides what it does.
* the interpreter's: the job's stdin, stdout, stderr (unbuffered, as torchrun's ``-u``), working
  directory, environment, ``sys.argv`` and ``sys.path`` (the target's directory, then the job's
  ``PYTHONPATH``); the target runs as ``__main__`` (kept in ``sys.modules`` until the exit, as the
  interpreter keeps it); the exit is the
  interpreter's own (``atexit`` hooks, non-daemon threads joined), with its exit code; an uncaught
  exception is printed by the interpreter and exits 1.
* the zygote imports only third-party modules (no ``megatron_ext``: its modules read the
  environment and arm faults at import), starts no thread (checked before every fork) and calls
  ``gc.freeze()`` so the imported objects are never scanned again. For a target other than the
  Megatron-LM harness of its checkout, the checkout's modules are dropped first, so
  ``megatron.training`` comes from wherever a cold process would find it.

What differs from cold ranks: the ranks of a session share the zygote's string-hash seed
(``PYTHONHASHSEED``), so a set of strings iterates in the same order on every rank, where cold
ranks would each draw their own; and ``/proc/<pid>/cmdline`` shows the zygote's command line.
``MEGATRON_EXT_COLD_RANKS=1`` runs the whole suite cold. Every cold start of a session is logged
with its reason in the zygotes' directory (never on the job's stderr, which tests read) and counted
in pytest's terminal summary.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import sys
import time

ENV = "MEGATRON_EXT_WARM_RANKS"  # the zygotes' directory (one folder each), set by tests/conftest.py
FLAVOURS = ("megatron", "deepspeed")
SOCKET_NAME = "zygote.sock"
PID_NAME = "zygote.pid"
COLD_LOG_NAME = "cold.log"  # in the zygotes' directory: every job that started cold, and why
READY_TIMEOUT_S = 300.0  # the zygote's imports: 15-40 s on the 2-core VMs
CLOSE_TIMEOUT_S = 30.0  # torchrun's grace between SIGTERM and SIGKILL when it stops its workers
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE
HARNESS = "megatron_ext.testing.megatron_lm"
# Environment the zygote's imports may have read: a job that sets any of these otherwise runs cold.
# PYTHON*: what the interpreter reads at start-up; DS_*: DeepSpeed's, where the zygote imported it. Exempt: what torchrun sets per worker, what a rank
# sets up itself (its sys.path, its unbuffered output), and torch's CUDA detection, read at each call
# (DeepSpeed sets it at import in the test process; a zygote never serves a machine with a GPU).
IMPORT_ENV_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GLOO_", "NVTE_", "DS_", "PYTHON")
IMPORT_ENV_EXEMPT = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONPATH", "PYTHONUNBUFFERED",
                     "PYTORCH_NVML_BASED_CUDA_CHECK")
# Read only by a function that writes the value back each time it reads it (inductor's cache_dir()):
# when the zygote's imports left it unset, they never read it, and a rank reads the job's value.
WRITTEN_BACK_WHEN_READ = ("TORCHINDUCTOR_CACHE_DIR",)


# ---------------------------------------------------------------------------- the test session's zygote
def flavour_of(target: list[str]) -> str:
    """Which zygote serves a job: DeepSpeed's for a DeepSpeed harness or worker (its module or script
    names DeepSpeed). Not the environment: a test process that imported DeepSpeed, or a test module
    that set ``DS_ACCELERATOR`` for one, passes it on to every job it launches."""
    return "deepspeed" if any("deepspeed" in part for part in target[:2]) else "megatron"


def start_zygote(directory: str, flavour: str, env: dict, checkout: str | None = None):
    """Start a zygote in ``directory/flavour`` in the background (its imports take 10-40 s); jobs wait for it."""
    import subprocess

    home = os.path.join(directory, flavour)
    os.makedirs(home)
    cmd = [sys.executable, __file__, "serve", home, flavour, *([checkout] if checkout else [])]
    with open(os.path.join(home, "zygote.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    with open(os.path.join(home, PID_NAME), "w") as f:
        f.write(str(proc.pid))
    return proc


def stop_zygote(proc) -> None:
    """End the zygote (running jobs keep their supervisors and ranks until they end)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except Exception:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- the launcher (client)
def _parse_launch(argv: list[str]) -> dict | None:
    """torchrun's one-node command line as ``megatron_ext.procs.torchrun_command`` writes it, else None."""
    flags = {"--nnodes": None, "--nproc-per-node": None, "--master-addr": None, "--master-port": None}
    i = 0
    while i < len(argv) and argv[i] in flags:
        if i + 1 >= len(argv):
            return None
        flags[argv[i]] = argv[i + 1]
        i += 2
    target = argv[i:]
    if None in flags.values() or flags["--nnodes"] != "1" or not target or target[0].startswith("-") and target[0] != "-m":
        return None
    if target[0] == "-m" and len(target) < 2:
        return None
    return {"nproc": int(flags["--nproc-per-node"]), "master_addr": flags["--master-addr"],
            "master_port": int(flags["--master-port"]), "target": target}


def _parse_run(argv: list[str]) -> dict | None:
    """``python (-m MODULE | -c CODE | SCRIPT) ARGS...``, else None."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-m", "-c")) or (argv[0] in ("-m", "-c") and len(argv) < 2):
        return None
    return {"nproc": 1, "single": True, "target": argv}


def _cold(argv: list[str], why: str | None, single: bool = False) -> None:
    """Run the job as it is written. Why goes to the session's log of cold starts, not to the job's
    stderr: tests read that stream, and a cold start must not change what they see."""
    directory = os.environ.get(ENV)
    if why and directory:
        try:
            with open(os.path.join(directory, COLD_LOG_NAME), "a") as log:
                log.write(f"[warm_ranks] {time.strftime('%H:%M:%S')} cold start of {' '.join(argv)[:160]} because {why}\n")
        except OSError:
            pass  # the session ended under a job still starting: nothing to account it to
    os.execv(sys.executable, [sys.executable, *([] if single else ["-m", "torch.distributed.run"]), *argv])


def _connect(directory: str) -> socket.socket | str:
    """A connection to the session's zygote, or why there is none."""
    path, pid_path = os.path.join(directory, SOCKET_NAME), os.path.join(directory, PID_NAME)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not os.path.exists(path):
        try:
            with open(pid_path) as f:
                os.kill(int(f.read()), 0)
        except (OSError, ValueError):
            return "the zygote is not running"
        if time.monotonic() > deadline:
            return f"the zygote was not ready after {READY_TIMEOUT_S:.0f} s"
        time.sleep(0.05)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        return f"cannot reach the zygote: {e}"
    return sock


class _Lines:
    """Newline-delimited JSON messages over a stream socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self) -> dict | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)


def launch(argv: list[str], single: bool = False) -> int:
    """Run one job through the session's zygote (or cold): torchrun's exit code, or the one process's."""
    job = _parse_run(argv) if single else _parse_launch(argv)
    directory = os.environ.get(ENV)
    if not directory or os.environ.get("MEGATRON_EXT_COLD_RANKS", "") not in ("", "0"):
        _cold(argv, None, single)
    if job is None:
        _cold(argv, "not a command line the zygote serves", single)
    connected = _connect(os.path.join(directory, flavour_of(job["target"])))
    if isinstance(connected, str):
        _cold(argv, connected, single)
    channel = _Lines(connected)
    job.update(env=dict(os.environ), cwd=os.getcwd(), client_pid=os.getpid())
    socket.send_fds(connected, [json.dumps(job).encode() + b"\n"], [0, 1, 2])
    reply = channel.recv()
    if reply is None or "accepted" not in reply:
        connected.close()
        _cold(argv, reply.get("refused") if reply else "the zygote closed the connection", single)
    for signum in FORWARDED:  # torchrun hands these on to its workers
        signal.signal(signum, lambda n, frame: channel.send({"signal": n}))
    while True:
        try:
            message = channel.recv()
        except InterruptedError:
            continue
        if message is None:
            print("[warm_ranks] the job's supervisor went away", file=sys.stderr, flush=True)
            return 1
        if "exit" in message:
            code = message["exit"]
            if code < 0:  # the one process died of a signal: so does its launcher, as a caller would see
                if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            return code


# ---------------------------------------------------------------------------- the zygote (server)
def _script_imports(path: str) -> list[str]:
    """The modules ``path`` imports at its top level (inside top-level ``try`` blocks too)."""
    tree = ast.parse(open(path).read(), path)
    names: list[str] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Try):
            todo += node.body
    return names


def _preload(flavour: str, checkout: str | None) -> None:
    """Import what the ranks import before their first instruction; nothing of ``megatron_ext``."""
    import importlib

    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if flavour == "deepspeed":
        import deepspeed  # noqa: F401  picks the accelerator DS_ACCELERATOR names
        import deepspeed.runtime.engine  # noqa: F401
    else:
        import megatron.core  # noqa: F401  the wheel's, with its prebuilt dataset helpers (as the harness does)
        import megatron.core.models.gpt  # noqa: F401
    if checkout:
        global _CHECKOUT_STAMP
        _CHECKOUT_STAMP = _patch_stamp(checkout)
        sys.path.insert(0, checkout)
        for name in _script_imports(os.path.join(checkout, "pretrain_gpt.py")):
            try:
                importlib.import_module(name)
            except Exception:  # an optional import of the script (modelopt, ...): a cold rank fails the same way
                pass
        # and what Megatron-LM imports while it starts: the tokenizers (--tokenizer-type NullTokenizer
        # too: their package imports transformers, a third of a warm rank's start-up otherwise)
        for name in ("megatron.training.training", "megatron.training.arguments",
                     "megatron.training.checkpointing", "megatron.training.initialize",
                     "megatron.core.tokenizers.text.models"):
            importlib.import_module(name)
    leaked = sorted(m for m in sys.modules if m == "megatron_ext" or m.startswith("megatron_ext."))
    if leaked:
        raise RuntimeError(f"the zygote imported {leaked}: their import-time state would be shared by every rank")


_CHECKOUT_STAMP: str | None = None  # the checkout's patch series when the zygote imported it


def _patch_stamp(checkout: str) -> str | None:
    """Which patch series the checkout carries (``scripts/fetch_megatron.sh`` writes it when it patches)."""
    try:
        with open(os.path.join(checkout, ".megatron_ext_patches")) as f:
            return f.read()
    except OSError:
        return None


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _refusal(job: dict, gpu: bool, zygote_env: dict, set_by_imports: dict) -> str | None:
    """Why ``job`` cannot run on this zygote's imports, else None.

    A variable the job has as the zygote's imports left it counts as equal: the job's process
    inherited it from one that ran those imports (torch's inductor cache directory, which an import
    keeps when it is set already)."""
    if gpu:
        return "a GPU is visible: the GPU tests start their ranks as users do"
    if _threads() != 1:
        return f"the zygote runs {_threads()} threads: a fork would copy their locks"
    env = job["env"]
    prefixes = IMPORT_ENV_PREFIXES if "deepspeed" in sys.modules else tuple(p for p in IMPORT_ENV_PREFIXES if p != "DS_")
    keys = {k for k in (*env, *zygote_env) if k.startswith(prefixes) and not k.startswith(IMPORT_ENV_EXEMPT)}
    differ = sorted(k for k in keys if env.get(k) != zygote_env.get(k)
                    and not (k in set_by_imports and env.get(k) == set_by_imports[k])
                    and not (k in WRITTEN_BACK_WHEN_READ and k not in zygote_env and k not in set_by_imports))
    if differ:
        return f"the job sets {', '.join(differ)} unlike the zygote, whose imports read them"
    return None


def serve(directory: str, flavour: str, checkout: str | None) -> dict | None:
    """Import once, then fork a supervisor per job; returns only in a rank process (its task)."""
    import gc
    import select

    zygote_env = dict(os.environ)  # what the imports read
    _preload(flavour, checkout)
    import torch

    gpu = torch.cuda.is_available()
    # What the imports wrote (torch's inductor cache directory): a cold rank's imports write it too.
    set_by_imports = {k: v for k, v in os.environ.items() if zygote_env.get(k) != v}
    gc.collect()
    gc.freeze()  # the imports live as long as the process: no collection scans them again
    parent = os.getppid()
    path = os.path.join(directory, SOCKET_NAME)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients wait for the name: it appears ready
    print(f"[warm_ranks] zygote {os.getpid()} ready ({len(sys.modules)} modules imported)", file=sys.stderr, flush=True)
    with listener:
        while True:
            ready, _, _ = select.select([listener], [], [], 1.0)
            _reap()
            if os.getppid() != parent:  # the test session is gone
                return None
            if not ready:
                continue
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            while not data.endswith(b"\n"):
                more = conn.recv(1 << 20)
                if not more:
                    break
                data += more
            job = json.loads(data)
            job["set_by_imports"] = set_by_imports
            why = _refusal(job, gpu, zygote_env, set_by_imports)
            print(f"[warm_ranks] {time.strftime('%H:%M:%S')} {job['nproc']} x {' '.join(job['target'])[:160]}: "
                  f"{'cold, ' + why if why else 'warm'}", file=sys.stderr, flush=True)
            if why is not None:
                _Lines(conn).send({"refused": why})
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            _Lines(conn).send({"accepted": True})
            if os.fork() == 0:
                listener.close()
                return _supervise(conn, job, fds, checkout, directory)
            conn.close()
            for fd in fds:
                os.close(fd)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---------------------------------------------------------------------------- a job's supervisor
def _supervise(conn: socket.socket, job: dict, fds: list[int], checkout: str | None, home: str):
    """Fork the job's ranks, host its store, watch them as torchrun does; returns only in a rank."""
    try:
        return _supervise_job(conn, job, fds, checkout, home)
    except BaseException:  # this process is the supervisor: it must never return into the zygote's loop
        import traceback

        traceback.print_exc()
        os._exit(1)


def _supervise_job(conn: socket.socket, job: dict, fds: list[int], checkout: str | None, home: str):
    import select

    ranks: dict[int, int] = {}  # pid -> rank
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            return {"job": job, "rank": rank, "fds": fds, "checkout": checkout}
        ranks[pid] = rank
    listed = _list_ranks(home, job["client_pid"], list(ranks))
    channel = _Lines(conn)
    err = os.fdopen(os.dup(fds[2]), "w", buffering=1)
    for fd in fds:
        os.close(fd)
    exit_code = 0
    single = job.get("single", False)
    try:
        if not single:
            from torch.distributed import TCPStore

            store = TCPStore(job["master_addr"], job["master_port"], job["nproc"], True,  # noqa: F841 kept for the job
                             wait_for_workers=False)
    except Exception as e:  # the port taken meanwhile: as torchrun, the job fails
        err.write(f"[warm_ranks] cannot host the job's store on port {job['master_port']}: {e}\n")
        _stop(ranks, signal.SIGKILL, 0, conn, err)
        exit_code = 1
    pidfds = {os.pidfd_open(pid): pid for pid in ranks}
    failed = exit_code != 0
    while pidfds:
        ready, _, _ = select.select([conn, *pidfds], [], [])
        if conn in ready:
            message = _read(channel)
            if message is None:  # the launcher is gone (killed): its ranks go with it
                _stop({p: ranks[p] for p in pidfds.values()}, signal.SIGKILL, 0, None, err)
                os._exit(1)
            signum = signal.Signals(message["signal"])
            if single:  # the caller's signal goes to its one process, which decides what it does
                os.kill(next(iter(pidfds.values())), signum)
                continue
            err.write(f"[warm_ranks] received {signum.name}: stopping the ranks as torchrun does\n")
            _stop({p: ranks[p] for p in pidfds.values()}, signum, CLOSE_TIMEOUT_S, conn, err)
            exit_code = 128 + signum  # torchrun's exit after a death signal
            break
        for fd in [fd for fd in ready if fd in pidfds]:
            pid = pidfds.pop(fd)
            os.close(fd)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if single:
                exit_code = code
            elif code != 0 and not failed:
                failed, exit_code = True, 1
                err.write(f"[warm_ranks] rank {ranks[pid]} (pid {pid}) exited with {_described(code, pid)}: "
                          "stopping the others\n")
                _stop({p: ranks[p] for p in pidfds.values()}, signal.SIGTERM, CLOSE_TIMEOUT_S, conn, err)
    _reap_all()
    os.unlink(listed)
    err.flush()
    try:
        channel.send({"exit": exit_code})
    except OSError:
        pass
    os._exit(0)


def _list_ranks(home: str, client_pid: int, pids: list[int]) -> str:
    """Name a job's ranks under its launcher's pid (``job_ranks``), for tests that kill a job's whole tree."""
    directory = os.path.join(home, "jobs")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, str(client_pid))
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(map(str, pids)))
    os.rename(path + ".tmp", path)
    return path


def job_ranks(launcher_pid: int) -> list[int]:
    """The rank pids of the warm job whose launcher is ``launcher_pid`` (none for a cold one: torchrun's ranks
    are its own descendants)."""
    directory = os.environ.get(ENV)
    for flavour in FLAVOURS if directory else ():
        try:
            with open(os.path.join(directory, flavour, "jobs", str(launcher_pid))) as f:
                return [int(p) for p in f.read().split()]
        except FileNotFoundError:
            continue
    return []


def _described(code: int, pid: int) -> str:
    """An exit code as torchrun's failure report words it (a signal by its name)."""
    if code >= 0:
        return str(code)
    return f"{code} (Signal {-code} ({signal.Signals(-code).name}) received by PID {pid})"


def _read(channel: _Lines) -> dict | None:
    try:
        return channel.recv()
    except (OSError, ValueError):
        return None


def _stop(ranks: dict[int, int], signum: int, timeout_s: float, conn: socket.socket | None, err) -> None:
    """``signum`` to every rank still running, then SIGKILL to those left after ``timeout_s``."""
    import select

    alive = {}
    for pid in ranks:
        try:
            alive[os.pidfd_open(pid)] = pid
            os.kill(pid, signum)
        except (ProcessLookupError, OSError):
            pass
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        watch = [*alive, *([conn] if conn is not None else [])]
        ready, _, _ = select.select(watch, [], [], max(0.0, deadline - time.monotonic()))
        if conn is not None and conn in ready and _read(_Lines(conn)) is None:
            break  # the launcher is gone: no grace left
        for fd in [fd for fd in ready if fd in alive]:
            alive.pop(fd)
            os.close(fd)
    for fd, pid in alive.items():
        err.write(f"[warm_ranks] rank {ranks[pid]} (pid {pid}) still running: SIGKILL\n")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)


def _reap_all() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


# ---------------------------------------------------------------------------- a rank
def _rank_environment(job: dict, rank: int) -> dict:
    """The job's environment plus what torchrun's agent gives each worker of a one-node job."""
    n = job["nproc"]
    env = {**job["set_by_imports"], **job["env"]}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
               LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(n),
               MASTER_ADDR=job["master_addr"], MASTER_PORT=str(job["master_port"]), TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="True",
               TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers
    return env


def _drop_checkout_modules(checkout: str) -> None:
    """Forget the modules imported from ``checkout``: this target would not have found them."""
    import megatron

    root = os.path.realpath(checkout) + os.sep
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and os.path.realpath(file).startswith(root):
            del sys.modules[name]
    if "megatron.training" not in sys.modules and hasattr(megatron, "training"):
        delattr(megatron, "training")


def run_rank(task: dict) -> None:
    """Become rank ``task['rank']`` of the job and run its target as ``__main__``."""
    import io

    job, rank, (in_fd, out_fd, err_fd) = task["job"], task["rank"], task["fds"]
    os.setsid()  # torchrun starts each worker in a session of its own
    for signum in (*FORWARDED, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, target in ((in_fd, 0), (out_fd, 1), (err_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update({**job["set_by_imports"], **job["env"]} if job.get("single") else _rank_environment(job, rank))
    target = job["target"]
    module = target[1] if target[0] == "-m" else None
    checkout = task["checkout"]
    same = module == HARNESS and _harness_checkout(target) == os.path.realpath(checkout or "")
    if checkout and not (same and _patch_stamp(checkout) == _CHECKOUT_STAMP):  # another target, or re-patched since
        _drop_checkout_modules(checkout)
    first = job["cwd"] if module else "" if target[0] == "-c" else os.path.dirname(os.path.abspath(target[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    _run_as_main(module, target)


def _run_as_main(module: str | None, target: list[str]) -> None:
    """Run ``-m MODULE args`` or ``SCRIPT args`` in a fresh ``__main__`` that stays until the exit.

    As the interpreter does (and unlike ``runpy.run_module``/``run_path``, which drop the module
    when the code returns): what the code leaves in its globals lives through the ``atexit`` hooks.
    """
    import importlib.util
    import types

    main = types.ModuleType("__main__")
    if module:
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise SystemExit(f"{sys.executable}: No module named {module}")
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(module + ".__main__")
        code = spec.loader.get_code(spec.name)
        main.__dict__.update(__file__=spec.origin, __spec__=spec, __loader__=spec.loader, __package__=spec.parent,
                             __cached__=spec.cached)
        sys.argv = [spec.origin, *target[2:]]
    elif target[0] == "-c":
        code = compile(target[1], "<string>", "exec")
        sys.argv = ["-c", *target[2:]]
    else:
        path = os.path.abspath(target[0])
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")
        main.__dict__.update(__file__=target[0], __cached__=None)
        sys.argv = list(target)
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _harness_checkout(target: list[str]) -> str | None:
    if "--checkout" in target:
        i = target.index("--checkout")
        if i + 1 < len(target):
            return os.path.realpath(target[i + 1])
    return None


# The interpreter's own entries of sys.path (stdlib, site-packages), without this script's
# directory and the PYTHONPATH entries the zygote started with.
_BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def main(argv: list[str]) -> int:
    if argv[:1] in (["launch"], ["run"]):
        return launch(argv[1:], single=argv[0] == "run")
    if argv[:1] == ["serve"] and len(argv) in (3, 4) and argv[2] in FLAVOURS:
        task = serve(argv[1], argv[2], argv[3] if len(argv) == 4 else None)
        if task is None:
            return 0
        run_rank(task)  # this process is a rank now: its exit is the target's
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
