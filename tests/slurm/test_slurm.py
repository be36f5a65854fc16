"""The Slurm templates and scripts/launch.sh against a real one-node Slurm (see helpers/slurm_cluster.py).

* every template's ``#SBATCH`` directives pass ``sbatch --test-only`` on this cluster (as written
  when it fits one node, otherwise the only complaint is the node count, and with ``--nodes=1``
  they pass), and a misspelt directive does fail, so the check has teeth;
* ``launch.sh --dry-run`` prints one torchrun per node with the right ranks and flags, and
  rejects bad inputs with clear errors;
* the CPU configurations submitted with ``sbatch`` train with ``--use-datastates --save-interval 1``,
  receive the time-limit signal mid-run (``scancel --signal=USR1 --batch``), save the iteration
  in flight, requeue themselves with ``scontrol requeue``, and the new run resumes from exactly
  that iteration to the end: Megatron-LM's own ``pretrain_gpt.py`` (the path of every GPU
  template; per-iteration loss and grad norm equal an uninterrupted job's) and the reference trainer;
* restarts: a busy rendezvous port and a step that fails to start are handled by the launcher.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launch_site import placeholder_site
from helpers.procs import free_port
from helpers.slurm_cluster import Cluster, ClusterUnavailable, ensure_installed

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch.sh"
TEMPLATES = {  # template -> nodes of 4x A100-40GB (paper configurations)
    "gpt_3b": 1, "gpt_7b": 2, "gpt_13b": 4, "gpt_30b": 8, "gpt_70b": 20, "gpt_70b_180gpu": 45,
}
PYTHON = sys.executable
_LLAMA = ("--swiglu --normalization RMSNorm --norm-epsilon {eps} --position-embedding-type rope --rotary-base 10000 "
          "--untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 1")
ARCHITECTURES = {  # template -> the architecture flags of its command line (docs/SLURM.md, "Architectures")
    "gpt_3b": "--ffn-hidden-size 10240 --normalization LayerNorm --norm-epsilon 1e-5 --position-embedding-type none",
    "gpt_7b": "--ffn-hidden-size 11008 " + _LLAMA.format(eps="1e-5"),
    "gpt_13b": "--ffn-hidden-size 13824 " + _LLAMA.format(eps="1e-5"),
    "gpt_30b": "--ffn-hidden-size 17920 " + _LLAMA.format(eps="1e-6"),
    "gpt_70b": "--ffn-hidden-size 28672 --group-query-attention --num-query-groups 8 " + _LLAMA.format(eps="1e-5"),
    "gpt_70b_180gpu": "--ffn-hidden-size 28672 --group-query-attention --num-query-groups 8 " + _LLAMA.format(eps="1e-5"),
}


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root here (slurmd, munged as the munge user)")
    try:
        ensure_installed()
    except ClusterUnavailable as exc:
        pytest.skip(f"cannot run a real Slurm: {exc}")
    c = Cluster()
    try:
        c.start()
    except ClusterUnavailable as exc:
        c.stop()
        pytest.skip(f"cannot run a real Slurm: {exc}")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture()
def site(tmp_path):
    """Site settings as a user would write them, pointing at placeholder paths."""
    return placeholder_site(tmp_path, PYTHON=PYTHON, MEGATRON_EXT_DIR=str(REPO))


def _env(cluster: Cluster, site: Path, **extra: str) -> dict:
    env = dict(cluster.env, SITE_ENV=str(site), MEGATRON_EXT_DIR=str(REPO))
    for key in list(env):
        if key.startswith(("SLURM_JOB", "SLURM_NNODES", "SBATCH_")) or key in (
                "MODEL_CONFIG", "TRAINER", "MEGATRON_ENTRY", "MEGATRON_RECORD", "CUDA_DEVICE_MAX_CONNECTIONS"):
            env.pop(key)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------- templates
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_passes_sbatch_test_only(cluster, site, tmp_path, name):
    template = REPO / "slurm" / f"{name}.sh"
    text = template.read_text()
    assert subprocess.run(["bash", "-n", str(template)]).returncode == 0
    # Tiny and site-free: the model comes from the config, everything else from launch.sh.
    assert f"--config {name}" in text and "scripts/launch.sh" in text
    assert f"#SBATCH --nodes={TEMPLATES[name]}\n" in text
    for directive in ("--requeue", "--signal=B:USR1@", "--gpus-per-node=4", "--open-mode=append"):
        assert f"#SBATCH {directive}" in text
    assert not re.search(r"(?m)^#SBATCH --(account|partition|qos)", text)
    assert "/lustre" not in text and "module load" not in text

    env = _env(cluster, site)
    res = cluster.run("sbatch", "--test-only", str(template), check=False)
    if TEMPLATES[name] <= 1:
        assert res.returncode == 0, res.stderr
        assert "to start at" in res.stderr
    else:
        # The one-node cluster cannot hold N nodes; that must be the only complaint.
        assert res.returncode != 0
        assert "Requested node configuration is not available" in res.stderr, res.stderr
    res = subprocess.run(["sbatch", "--test-only", "--nodes=1", str(template)], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert re.search(r"to start at .* on nodes " + re.escape(cluster.hostname), res.stderr), res.stderr

    # Negative control: sbatch --test-only does reject a misspelt directive.
    bad = tmp_path / f"{name}_bad.sh"
    bad.write_text(text.replace("#SBATCH --requeue", "#SBATCH --requeu-typo"))
    res = subprocess.run(["sbatch", "--test-only", "--nodes=1", str(bad)], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "node configuration" not in res.stderr


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_dry_run_one_command_per_node(cluster, site, name):
    nodes = TEMPLATES[name]
    res = subprocess.run([str(LAUNCH), "--config", name, "--dry-run", "--nodes", str(nodes)],
                         env=_env(cluster, site), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("node ")]
    assert len(lines) == nodes
    ckpt = str(site.parent / "lustre" / name)
    for k, line in enumerate(lines):
        assert line.startswith(f"node {k} host node{k:03d} ranks {4 * k}-{4 * k + 3}: ")
        assert f"--nnodes {nodes} --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node000:29500" in line
        assert f"--save {ckpt} --load {ckpt} --save-interval 1 --use-datastates" in line
        assert f"--datastates-local-dir {site.parent / 'scratch' / name}" in line
        assert "--tensor-model-parallel-size 4 " in line and "pretrain_gpt.py" in line
        assert "--exit-signal-handler" in line
        # Megatron-LM asserts it when TP > 1, on GPUs too.
        assert "; export CUDA_DEVICE_MAX_CONNECTIONS=1; " in line
        # The paper's architecture (tests/configs checks its size), no dropout.
        assert ARCHITECTURES[name] + " " in line
        assert "--hidden-dropout 0 --attention-dropout 0 " in line
        assert ("--group-query-attention" in line) == name.startswith("gpt_70b")
    pp = 5 if name == "gpt_70b_180gpu" else nodes
    assert f"TP=4 PP={pp} DP={4 * nodes // (4 * pp)}" in res.stdout


def test_dry_run_inside_an_allocation(cluster, site):
    """Inside Slurm the nodes come from SLURM_JOB_NODELIST (expanded by scontrol); the rendezvous
    endpoint is its first host, and ranks follow c10d's sorted order of host names."""
    env = _env(cluster, site, SLURM_JOB_NODELIST="gpu-[07-08,10-11]", SLURM_NNODES="4", SLURM_JOB_ID="4242")
    res = subprocess.run([str(LAUNCH), "--config", "gpt_13b", "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("node ")]
    assert [line.split(":")[0] for line in lines] == [
        "node 0 host gpu-07 ranks 0-3", "node 1 host gpu-08 ranks 4-7",
        "node 2 host gpu-10 ranks 8-11", "node 3 host gpu-11 ranks 12-15"]
    assert all("--nnodes 4 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint gpu-07:29500 "
               "--rdzv-id 4242-0-0 " in line for line in lines)
    assert "is sized for" not in res.stderr
    # A smaller allocation than the config was sized for: warned, and PP follows the nodes.
    env.update(SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_NNODES="2")
    res = subprocess.run([str(LAUNCH), "--config", "gpt_13b", "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "gpt_13b is sized for 4 nodes, the allocation has 2" in res.stderr
    assert "TP=4 PP=2 DP=1" in res.stdout
    # A site's own CUDA_DEVICE_MAX_CONNECTIONS is kept.
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="8")
    res = subprocess.run([str(LAUNCH), "--config", "gpt_13b", "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("node ")]
    assert lines and all("; export CUDA_DEVICE_MAX_CONNECTIONS=8; " in line for line in lines)


@pytest.mark.parametrize("args, extra_env, message", [
    (["--dry-run", "--nodes", "1"], {}, "no model config"),
    (["--config", "gpt_999b", "--dry-run", "--nodes", "1"], {}, "model config 'gpt_999b' not found"),
    (["--config", "gpt_3b", "--dry-run", "--nodes", "1"], {"MEGATRON_LM_DIR": "/nonexistent/Megatron-LM"},
     "MEGATRON_LM_DIR=/nonexistent/Megatron-LM is not a directory"),
    (["--config", "gpt_70b", "--dry-run", "--nodes", "3"], {}, "80 layers do not split into PP=3"),
    (["--config", "gpt_3b"], {}, "no allocation"),
    (["--config", "gpt_3b", "--dry-run", "--nodes", "0"], {}, "--nodes must be a positive integer"),
    (["--config", "gpt_3b", "--dry-run", "--nodes", "1"], {"STEP_RETRIES": "two"},
     "STEP_RETRIES must be a whole number, not 'two'"),
    (["--config", "gpt_3b", "--dry-run", "--nodes", "1"], {"PORT_WAIT_S": "-1"},
     "PORT_WAIT_S must be a whole number, not '-1'"),
])
def test_launcher_rejects_bad_inputs(cluster, site, tmp_path, args, extra_env, message):
    env = _env(cluster, site)
    if "MEGATRON_LM_DIR" in extra_env:  # the site file would set it again: use a site without it
        other = tmp_path / "site-no-megatron.env"
        other.write_text("\n".join(line for line in site.read_text().splitlines()
                                   if not line.startswith("MEGATRON_LM_DIR")) + "\n")
        env["SITE_ENV"] = str(other)
    env.update(extra_env)
    res = subprocess.run([str(LAUNCH), *args], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert message in res.stderr, res.stderr


# ---------------------------------------------------------------------------- CPU jobs
JOB_TIMEOUT_S = 300
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _wait(what: str, predicate, timeout: float, interval: float = 0.2, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{on_timeout()}")


class Job:
    """A batch job of this cluster: submit, follow, and explain itself when something goes wrong."""

    def __init__(self, cluster: Cluster, template: Path, out: Path, env: dict, tracker: Path):
        self.cluster, self.out, self.tracker = cluster, out, tracker
        res = subprocess.run(["sbatch", "--parsable", "-o", str(out), str(template)],
                             env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        self.id = res.stdout.strip().split(";")[0]

    def field(self, name: str) -> str | None:
        return self.cluster.job_field(self.id, name)

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def committed(self) -> int:
        try:
            return int(self.tracker.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def report(self) -> str:
        """Slurm's view, every run's launcher lines, the output's end, and the daemons' log lines."""
        text = self.text() or "(no output yet)"
        launcher = "\n".join(line for line in text.splitlines() if line.startswith("launch.sh:"))
        daemons = ""
        for daemon in ("slurmctld", "slurmd"):
            path = self.cluster.base / "log" / f"{daemon}.log"
            try:
                lines = [line for line in path.read_text().splitlines()
                         if f"JobId={self.id}" in line or f"job {self.id}" in line.lower()
                         or f"[{self.id}." in line or "credential" in line.lower()]
            except OSError:
                lines = []
            daemons += f"\n--- {path} (lines about job {self.id}) ---\n" + "\n".join(lines[-30:])
        show = self.cluster.run("scontrol", "show", "job", self.id, check=False).stdout
        return (f"--- job {self.id} ---\n{show}\n--- launcher lines of every run in {self.out} ---\n{launcher}"
                f"\n--- end of {self.out} ---\n{text[-6000:]}{daemons}")

    def wait_requeued(self) -> None:
        _wait("the job to be requeued", lambda: (self.field("Restarts") or "0") != "0", JOB_TIMEOUT_S,
              interval=0.5, on_timeout=self.report)

    def wait_finished(self, start_requeued: bool = False) -> str:
        """Waits until the job has ended; with ``start_requeued``, starts a requeued run early.

        Slurm holds a requeued job back for ``cred_expire`` (120 s by default; slurm.conf(5): "This
        also controls how long a requeued job must wait before starting again"). The test starts
        it sooner, but never within the same second as the requeue: slurmd revoked the first run's
        job credential at that moment and refuses any credential of the job issued in the same
        second (``cred->ctime <= revoked``). The job then ends FAILED without running its script
        (RunTime 0, ExitCode 1:0, slurmctld: "Killing non-startable batch JobId=N: Job credential
        revoked"): what made this test flaky on a loaded machine.
        """
        pending_since: list[float] = []

        def ended() -> bool:
            state = self.field("JobState")
            if start_requeued and state == "PENDING":
                if not pending_since:
                    pending_since.append(time.monotonic())
                elif time.monotonic() - pending_since[0] >= 2.0:
                    self.cluster.run("scontrol", "update", f"JobId={self.id}", "StartTime=now", check=False)
            return state in ENDED

        _wait(f"job {self.id} to end", ended, JOB_TIMEOUT_S, interval=0.5, on_timeout=self.report)
        return self.field("JobState") or ""


def _processes_mentioning(marker: str) -> list:
    """Live processes whose command line contains ``marker`` (a path only this test uses)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _signal_requeue_and_resume(cluster: Cluster, site: Path, tmp_path: Path, template: str, config: str,
                               train_iters: int, **env_extra: str) -> tuple[Job, str, str, int]:
    """Submits ``template``, signals it like the time limit does after a few committed checkpoints,
    lets it requeue itself, starts the requeued run, and checks what both runs' output says.

    Returns the job, the first and the second run's output and the iteration committed at the stop.
    """
    ckpt_dir = tmp_path / "lustre" / config
    job = Job(cluster, REPO / "slurm" / f"{template}.sh", tmp_path / "job.out",
              _env(cluster, site, TRAIN_ITERS=str(train_iters), STOP_GRACE_S="60", MASTER_PORT=str(free_port()),
                   **env_extra),
              ckpt_dir / "latest_checkpointed_iteration.txt")
    # 1. Let it commit a few checkpoints, then deliver the time-limit signal to the batch shell.
    _wait("a few committed checkpoints", lambda: job.committed() >= 5, JOB_TIMEOUT_S, on_timeout=job.report)
    assert job.committed() < train_iters, "training finished before the signal: raise the iterations"
    cluster.run("scancel", "--signal=USR1", "--batch", job.id)

    # 2. The launcher stops the step gracefully and requeues the job (Restarts=1).
    job.wait_requeued()
    stopped_at = job.committed()
    assert 5 <= stopped_at < train_iters, job.report()
    # Slurm ended every process of the first run before the job can start again.
    _wait("the first run's processes to exit", lambda: not _processes_mentioning(str(ckpt_dir)), 60,
          interval=0.5, on_timeout=job.report)
    state = job.wait_finished(start_requeued=True)
    assert state == "COMPLETED", job.report()
    assert job.field("Restarts") == "1", job.report()
    assert job.committed() == train_iters, job.report()

    # 3. What the job's own output says: both runs, one after the other (--open-mode=append).
    text = job.text()
    assert "caught SIGUSR1" in text and f"requeueing job {job.id}" in text, job.report()
    assert text.count(f"launch.sh: job {job.id} restart ") == 2, job.report()
    first, second = text.split(f"launch.sh: job {job.id} restart 1:", 1)
    assert f"launch.sh: job {job.id} restart 0: {config} " in first
    assert "latest committed iteration: none" in first
    assert re.search(r"--save-interval 1 --use-datastates\b", first), job.report()
    assert "--exit-signal-handler" in first
    # The graceful stop committed the iteration in flight; the second run resumes right there.
    assert re.search(rf"training step ended with exit code \d+ after \d+s; latest committed iteration: "
                     rf"{stopped_at}\n", first), job.report()
    m = re.search(r"latest committed iteration: (\d+)", second)
    assert m and int(m.group(1)) == stopped_at, job.report()
    assert f"[datastates] loaded iter_{stopped_at:07d}" in second, job.report()
    assert re.search(rf"training step ended with exit code 0 after \d+s; latest committed iteration: "
                     rf"{train_iters}\n", second), job.report()
    assert "launch.sh: the step failed" not in text, job.report()
    return job, first, second, stopped_at


@pytest.fixture(scope="module")
def megatron_checkout():
    from megatron_ext.testing.megatron_lm import find_checkout

    checkout, reason = find_checkout()
    if checkout is None:
        pytest.skip(reason)
    return checkout


@pytest.fixture()
def megatron_site(tmp_path, megatron_checkout):
    """Site settings pointing at the patched Megatron-LM checkout (scripts/fetch_megatron.sh)."""
    env_file = tmp_path / "site-megatron.env"
    env_file.write_text(f"MEGATRON_LM_DIR={megatron_checkout}\nCKPT_ROOT={tmp_path / 'lustre'}\n"
                        f"LOCAL_SCRATCH={tmp_path / 'scratch'}\nPYTHON={PYTHON}\nMEGATRON_EXT_DIR={REPO}\n")
    return env_file


def test_cpu_megatron_config_runs_the_harness_with_its_cpu_flags(megatron_site):
    """The CPU config's one hook runs pretrain_gpt.py through the test harness with exactly the
    harness's CPU flags; GPU configs run pretrain_gpt.py itself."""
    from megatron_ext.testing.megatron_lm import CPU_FLAGS

    env = dict(os.environ, SITE_ENV=str(megatron_site))
    for key in ("MODEL_CONFIG", "TRAINER", "MEGATRON_ENTRY", "SLURM_JOB_NODELIST", "CUDA_DEVICE_MAX_CONNECTIONS"):
        env.pop(key, None)
    res = subprocess.run([str(LAUNCH), "--config", "cpu_tiny_megatron", "--dry-run", "--nodes", "1"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    line = res.stdout.splitlines()[-1]
    checkout = re.search(r"^MEGATRON_LM_DIR=(.*)$", megatron_site.read_text(), re.M).group(1)
    assert f"--max-restarts 0 -m megatron_ext.testing.megatron_lm --checkout {checkout} -- " in line
    assert "pretrain_gpt.py" not in line  # the harness runs the checkout's pretrain_gpt.py itself
    assert " ".join(CPU_FLAGS) + " --seed 1234" in line
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1; " in line
    assert "--record" not in line
    env["MEGATRON_RECORD"] = "/tmp/steps.jsonl"
    res = subprocess.run([str(LAUNCH), "--config", "cpu_tiny_megatron", "--dry-run", "--nodes", "1"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert f"--checkout {checkout} --record /tmp/steps.jsonl -- " in res.stdout


def test_megatron_job_is_signalled_requeued_and_resumes(cluster, megatron_site, tmp_path):
    """The launcher's Megatron-LM path (what gpt_70b.sh runs) through a real requeue cycle: Megatron-LM's
    own pretrain_gpt.py on 2 CPU ranks gets the time-limit signal, saves the iteration in flight
    with --exit-signal-handler, the job requeues itself, the new run resumes from that iteration to
    the end, and every iteration's loss and grad norm equal an uninterrupted job's bit for bit."""
    from megatron_ext.testing.megatron_lm import read_records

    iters = 100
    records = tmp_path / "requeued.jsonl"
    job, first, second, stopped_at = _signal_requeue_and_resume(
        cluster, megatron_site, tmp_path, "cpu_tiny_megatron", "cpu_tiny_megatron", iters,
        MEGATRON_RECORD=str(records))
    assert "-m megatron_ext.testing.megatron_lm --checkout" in first
    # TP=2: Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1, which only the launcher sets here.
    assert "launch.sh: job" in first and "TP=2 PP=1 DP=1" in first
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1; " in first
    assert "exiting program after receiving SIGTERM" in first, job.report()
    # Megatron-LM's own log: the first run trained 1..stopped_at, the second stopped_at+1..end.
    logged = [int(i) for i in re.findall(r"\] iteration\s+(\d+)/\s*\d+ \|", second)]
    assert logged and logged[0] == stopped_at + 1 and logged[-1] == iters, job.report()
    steps = [r["iteration"] for r in read_records(records)]
    assert steps == list(range(1, iters + 1)), steps

    # The same job, never interrupted.
    plain_records = tmp_path / "uninterrupted.jsonl"
    plain = Job(cluster, REPO / "slurm" / "cpu_tiny_megatron.sh", tmp_path / "uninterrupted.out",
                _env(cluster, megatron_site, TRAIN_ITERS=str(iters), MASTER_PORT=str(free_port()),
                     RUN_NAME="uninterrupted", MEGATRON_RECORD=str(plain_records)),
                tmp_path / "lustre" / "uninterrupted" / "latest_checkpointed_iteration.txt")
    assert plain.wait_finished() == "COMPLETED", plain.report()
    resumed = [(r["iteration"], r["loss"], r["grad_norm"]) for r in read_records(records)]
    uninterrupted = [(r["iteration"], r["loss"], r["grad_norm"]) for r in read_records(plain_records)]
    assert resumed == uninterrupted, [(a, b) for a, b in zip(resumed, uninterrupted) if a != b][:5]


@pytest.mark.slow  # the Megatron-LM job above runs the same cycle in the default run
def test_reference_job_is_signalled_requeued_and_resumes(cluster, site, tmp_path):
    """The reference trainer (configs/cpu_tiny.env) through the same cycle; iterations both runs
    log (none, after a graceful stop) would have to agree."""
    iters = 150
    job, first, second, stopped_at = _signal_requeue_and_resume(cluster, site, tmp_path, "cpu_tiny", "cpu_tiny",
                                                                iters)
    assert "exit signal received" in first, job.report()
    iterations = [int(x) for x in re.findall(r"^iteration\s+(\d+) \| loss", second, re.M)]
    assert iterations and iterations[0] == stopped_at + 1 and iterations[-1] == iters, job.report()
    before = [int(x) for x in re.findall(r"^iteration\s+(\d+) \| loss", first, re.M)]
    assert before and before[-1] == stopped_at, job.report()


def test_restart_waits_for_a_busy_port_and_retries_a_step_that_fails_to_start(cluster, site, tmp_path):
    """Two things that stop a (re)started step before it trains, handled by the launcher: the
    rendezvous port is taken (it waits PORT_WAIT_S, then takes the next free port), and the first
    step fails on the node (here SITE_SETUP fails once, as a node that is not ready would): the
    step is retried after STEP_RETRY_DELAY_S with a fresh rendezvous id and trains to the end."""
    import socket

    marker = tmp_path / "node-was-not-ready"
    port = free_port()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", port))
        busy.listen()
        job = Job(cluster, REPO / "slurm" / "cpu_tiny.sh", tmp_path / "job.out",
                  _env(cluster, site, TRAIN_ITERS="3", MASTER_PORT=str(port), PORT_WAIT_S="3",
                       STEP_RETRY_DELAY_S="1", SITE_SETUP=f"if [ ! -e {marker} ]; then touch {marker}; "
                                                          "echo 'node not ready (test)'; exit 3; fi"),
                  tmp_path / "lustre" / "cpu_tiny" / "latest_checkpointed_iteration.txt")
        assert job.wait_finished() == "COMPLETED", job.report()
    text = job.text()
    host = cluster.hostname
    m = re.search(rf"launch.sh: rendezvous port {port} still in use after 3s: using port (\d+)\n", text)
    assert m and int(m.group(1)) > port, job.report()
    moved = int(m.group(1))
    expected = [
        f"rendezvous port {port} on {host} is in use; waiting up to 3s for it to be free",
        f"rendezvous port {port} still in use after 3s: using port {moved}",
        f"starting the training step (attempt 1 of 3, rendezvous {host}:{moved} id {job.id}-0-0)",
        "training step ended with exit code 3 after",
        "the step failed before committing a checkpoint: retry 1 of 2 in 1s",
        f"starting the training step (attempt 2 of 3, rendezvous {host}:{moved} id {job.id}-0-1)",
        "training step ended with exit code 0 after",
    ]
    positions = [text.find("launch.sh: " + line) for line in expected]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), job.report()
    assert "node not ready (test)" in text
    assert job.committed() == 3


def test_a_step_that_never_starts_is_retried_a_bounded_number_of_times(cluster, site, tmp_path):
    job = Job(cluster, REPO / "slurm" / "cpu_tiny.sh", tmp_path / "job.out",
              _env(cluster, site, MASTER_PORT=str(free_port()), STEP_RETRIES="2", STEP_RETRY_DELAY_S="1",
                   SITE_SETUP="echo 'node not ready (test)'; exit 3"),
              tmp_path / "lustre" / "cpu_tiny" / "latest_checkpointed_iteration.txt")
    assert job.wait_finished() == "FAILED", job.report()
    assert job.field("ExitCode") == "3:0", job.report()
    text = job.text()
    assert text.count("launch.sh: starting the training step") == 3, job.report()
    assert "retry 2 of 2" in text and "retry 3" not in text
    assert "launch.sh: the step failed 3 times without committing a checkpoint: giving up" in text, job.report()
