"""A real one-node Slurm (munged + slurmctld + slurmd) in a private directory, for the tests.

Follows /work/shared/notes/slurm.md: Debian's ``slurm-wlm`` and ``munge`` packages, no cgroups,
no systemd, daemons started directly as root (munged as the ``munge`` user). Everything the
cluster writes (munge key, socket, slurm.conf, spool, state, logs, pid files) lives in one fresh
directory, on free ports, so it never touches /etc/slurm or a Slurm that might already run; the
client commands find it through ``SLURM_CONF``. ``stop()`` ends the daemons by their pid files.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from megatron_ext.procs import free_port

from helpers.procs import alive

PACKAGES = ["slurm-wlm", "munge"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo"]
APT_TIMEOUT_S = 240
START_TIMEOUT_S = 60


class ClusterUnavailable(Exception):
    """Why a real Slurm cannot run on this machine (the tests skip with this message)."""


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt when a binary is missing; raise ClusterUnavailable if impossible."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"{', '.join(missing)} missing and not root: cannot apt-get install {PACKAGES}")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"{', '.join(missing)} missing and no apt-get on this machine")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    started = time.monotonic()
    try:
        upd = _run(["apt-get", "update", "-q"], APT_TIMEOUT_S, env)
        if upd.returncode != 0:
            raise ClusterUnavailable(f"apt-get update failed (exit {upd.returncode}): {upd.stderr.strip()[-500:]}")
        left = max(10.0, APT_TIMEOUT_S - (time.monotonic() - started))
        inst = _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES], left, env)
    except subprocess.TimeoutExpired as exc:
        raise ClusterUnavailable(f"apt-get did not finish within {APT_TIMEOUT_S}s: {exc.cmd}") from exc
    if inst.returncode != 0:
        raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed (exit {inst.returncode}): "
                                 f"{inst.stderr.strip()[-500:]}")
    still = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if still:
        raise ClusterUnavailable(f"installed {PACKAGES} but {still} are still missing")


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Cluster:
    """One node, one partition ``debug`` (Default=YES), all CPUs of this machine."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="megatron-ext-slurm-"))
        self.base.chmod(0o755)  # munged runs as the munge user and must reach its files
        self.hostname = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.gpus = 4
        self.conf = self.base / "slurm.conf"
        self.munge_dir = self.base / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.pidfiles = {
            "slurmd": self.base / "slurmd.pid",
            "slurmctld": self.base / "slurmctld.pid",
            "munged": self.munge_dir / "munged.pid",
        }
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.env.pop("SLURM_JOB_ID", None)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        self._start_munge()
        self._write_conf()
        for d in ("state", "spool", "log"):
            (self.base / d).mkdir()
        ctld = _run([_sbin("slurmctld"), "-f", str(self.conf), "-i"], 30, self.env)
        if ctld.returncode != 0:
            raise ClusterUnavailable(f"slurmctld failed to start: {ctld.stderr.strip()} {self.log_tail('slurmctld')}")
        slurmd = _run([_sbin("slurmd"), "-f", str(self.conf)], 30, self.env)
        if slurmd.returncode != 0:
            raise ClusterUnavailable(f"slurmd failed to start: {slurmd.stderr.strip()} {self.log_tail('slurmd')}")
        self.wait_idle(START_TIMEOUT_S)

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir()
        self.munge_dir.chmod(0o755)  # munged wants the socket directory reachable by all
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for p in (self.munge_dir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        cmd = ["runuser", "-u", "munge", "--", _sbin("munged"),
               f"--key-file={key}", f"--socket={self.munge_socket}",
               f"--pid-file={self.pidfiles['munged']}", f"--log-file={self.munge_dir / 'munged.log'}",
               f"--seed-file={self.munge_dir / 'munged.seed'}"]
        res = _run(cmd, 30)
        if res.returncode != 0:
            raise ClusterUnavailable(f"munged failed to start: {res.stderr.strip()}")
        # Check the credential round trip the daemons rely on.
        check = subprocess.run(f"munge -n -S {self.munge_socket} | unmunge -S {self.munge_socket}",
                               shell=True, capture_output=True, text=True, timeout=15)
        if check.returncode != 0:
            raise ClusterUnavailable(f"munge round trip failed: {check.stderr.strip()}")

    def _write_conf(self) -> None:
        # Four count-only "GPUs" (no device files): the templates' --gpus-per-node=4 is then
        # satisfiable per node, so sbatch --test-only checks them for real on one node.
        # slurmd drops file-less GPUs, so each one is an empty file in the cluster directory.
        for i in range(self.gpus):
            (self.base / f"fake-gpu{i}").touch()
        (self.base / "gres.conf").write_text(
            f"NodeName={self.hostname} Name=gpu File={self.base}/fake-gpu[0-{self.gpus - 1}]\n")
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
        real_mem = max(512, mem_mb - 1024)
        b = self.base
        self.conf.write_text(f"""\
# Written by tests/helpers/slurm_cluster.py: one node, no cgroups, no systemd.
ClusterName=megatronext
SlurmctldHost={self.hostname}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
GresTypes=gpu
StateSaveLocation={b / 'state'}
SlurmdSpoolDir={b / 'spool'}
SlurmctldPidFile={self.pidfiles['slurmctld']}
SlurmdPidFile={self.pidfiles['slurmd']}
SlurmctldLogFile={b / 'log' / 'slurmctld.log'}
SlurmdLogFile={b / 'log' / 'slurmd.log'}
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=600
KillWait=10
InactiveLimit=0
NodeName={self.hostname} CPUs={self.cpus} RealMemory={real_mem} Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=debug Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP
""")

    # ------------------------------------------------------------------ queries
    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        res = _run(list(cmd), timeout, self.env)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {res.returncode}): {res.stdout}{res.stderr}")
        return res

    def node_state(self) -> str:
        res = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return res.stdout.strip()

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.node_state()
            if state == "idle":
                return
            if state.startswith(("inval", "drain")):
                break
            time.sleep(1)
        raise ClusterUnavailable(f"node not idle after {timeout}s (state {state!r}); "
                                 f"{self.log_tail('slurmctld')} {self.log_tail('slurmd')}")

    def job_field(self, job_id: str, field: str) -> str | None:
        res = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if res.returncode != 0:
            return None
        for token in res.stdout.split():
            if token.startswith(field + "="):
                return token.split("=", 1)[1]
        return None

    def log_tail(self, daemon: str, lines: int = 20) -> str:
        path = self.base / "log" / f"{daemon}.log"
        try:
            return f"\n--- {path} ---\n" + "\n".join(path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Cancel our jobs, then stop every daemon we started by its pid file (TERM, KILL after 15 s)."""
        if _read_pid(self.pidfiles["slurmctld"]) is not None:
            try:
                self.run("scancel", "--user", pwd.getpwuid(os.getuid()).pw_name, timeout=15, check=False)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.run(
                        "squeue", "-h", "-o", "%i", timeout=10, check=False).stdout.strip():
                    time.sleep(1)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            pid = _read_pid(self.pidfiles[name])
            if pid is None or not alive(pid):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)
