"""The Slurm templates and scripts/launch.sh against a real one-node Slurm (see cluster.py).

* every template's ``#SBATCH`` directives pass ``sbatch --test-only`` on this cluster (as written
  when it fits one node, otherwise the only complaint is the node count, and with ``--nodes=1``
  they pass), and a misspelt directive does fail, so the check has teeth;
* ``launch.sh --dry-run`` prints one torchrun per node with the right ranks and flags, and
  rejects bad inputs with clear errors;
* the CPU configuration submitted with ``sbatch`` trains with ``--use-datastates --save-interval 1``,
  receives the time-limit signal mid-run (``scancel --signal=USR1 --batch``), requeues itself
  with ``scontrol requeue``, and the new run resumes from the committed checkpoint to the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Cluster, ClusterUnavailable, ensure_installed  # noqa: E402

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch.sh"
TEMPLATES = {  # template -> nodes of 4x A100-40GB (paper configurations)
    "gpt_3b": 1, "gpt_7b": 2, "gpt_13b": 4, "gpt_30b": 8, "gpt_70b": 20, "gpt_70b_180gpu": 45,
}
PYTHON = sys.executable
TRAIN_ITERS = 150
JOB_TIMEOUT_S = 200


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
    megatron = tmp_path / "Megatron-LM"
    megatron.mkdir()
    (megatron / "pretrain_gpt.py").write_text("raise SystemExit('placeholder')\n")
    env_file = tmp_path / "site.env"
    env_file.write_text(f"MEGATRON_LM_DIR={megatron}\nCKPT_ROOT={tmp_path / 'lustre'}\n"
                        f"LOCAL_SCRATCH={tmp_path / 'scratch'}\nPYTHON={PYTHON}\n"
                        f"MEGATRON_EXT_DIR={REPO}\n")
    return env_file


def _env(cluster: Cluster, site: Path, **extra: str) -> dict:
    env = dict(cluster.env, SITE_ENV=str(site), MEGATRON_EXT_DIR=str(REPO))
    for key in list(env):
        if key.startswith(("SLURM_JOB", "SLURM_NNODES", "SBATCH_")) or key in ("MODEL_CONFIG", "TRAINER"):
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
               "--rdzv-id 4242" in line for line in lines)
    assert "is sized for" not in res.stderr
    # A smaller allocation than the config was sized for: warned, and PP follows the nodes.
    env.update(SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_NNODES="2")
    res = subprocess.run([str(LAUNCH), "--config", "gpt_13b", "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "gpt_13b is sized for 4 nodes, the allocation has 2" in res.stderr
    assert "TP=4 PP=2 DP=1" in res.stdout


@pytest.mark.parametrize("args, extra_env, message", [
    (["--dry-run", "--nodes", "1"], {}, "no model config"),
    (["--config", "gpt_999b", "--dry-run", "--nodes", "1"], {}, "model config 'gpt_999b' not found"),
    (["--config", "gpt_3b", "--dry-run", "--nodes", "1"], {"MEGATRON_LM_DIR": "/nonexistent/Megatron-LM"},
     "MEGATRON_LM_DIR=/nonexistent/Megatron-LM is not a directory"),
    (["--config", "gpt_70b", "--dry-run", "--nodes", "3"], {}, "80 layers do not split into PP=3"),
    (["--config", "gpt_3b"], {}, "no allocation"),
    (["--config", "gpt_3b", "--dry-run", "--nodes", "0"], {}, "--nodes must be a positive integer"),
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


# ---------------------------------------------------------------------------- CPU job
def _wait(what: str, predicate, timeout: float, interval: float = 0.2, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{on_timeout()}")


def _trainer_processes() -> list:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "megatron_ext.megatron.trainer" in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_cpu_job_is_signalled_requeued_and_resumes(cluster, site, tmp_path):
    out = tmp_path / "job.out"
    env = _env(cluster, site, TRAIN_ITERS=str(TRAIN_ITERS), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               STOP_GRACE_S="30", MASTER_PORT=str(cluster_port()))
    res = subprocess.run(["sbatch", "--parsable", "-o", str(out), str(REPO / "slurm" / "cpu_tiny.sh")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    tracker = tmp_path / "lustre" / "cpu_tiny" / "latest_checkpointed_iteration.txt"

    def show() -> str:
        text = out.read_text() if out.exists() else "(no output yet)"
        return (f"--- job {job} ---\n{cluster.run('scontrol', 'show', 'job', job, check=False).stdout}"
                f"\n--- {out} ---\n{text[-6000:]}")

    def committed() -> int:
        try:
            return int(tracker.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    # 1. Let it commit a few checkpoints, then deliver the time-limit signal to the batch shell.
    _wait("a few committed checkpoints", lambda: committed() >= 5, JOB_TIMEOUT_S, on_timeout=show)
    assert committed() < TRAIN_ITERS, "training finished before the signal: raise TRAIN_ITERS"
    cluster.run("scancel", "--signal=USR1", "--batch", job)

    # 2. The launcher stops the step and requeues the job (Restarts=1).
    _wait("the job to be requeued", lambda: (cluster.job_field(job, "Restarts") or "0") != "0",
          JOB_TIMEOUT_S, interval=0.5, on_timeout=show)
    stopped_at = committed()
    assert 5 <= stopped_at < TRAIN_ITERS
    # The first run's training processes must be gone before the restart is forced, or the new
    # step can fail to launch on the one node (it did once, when the graceful stop took longer).
    _wait("the first run's processes to exit", lambda: not _trainer_processes(), JOB_TIMEOUT_S, interval=0.5,
          on_timeout=show)
    # Slurm delays a requeued job's start (BeginTime, about a minute); start it now so the test
    # stays short. The job may still be completing its first run: retry while it is not running.
    def finished() -> bool:
        state = cluster.job_field(job, "JobState")
        if state == "PENDING":
            cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
        return state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

    _wait("the requeued job to complete", finished, JOB_TIMEOUT_S, interval=1.0, on_timeout=show)
    text = out.read_text()
    assert cluster.job_field(job, "JobState") == "COMPLETED", show()
    assert cluster.job_field(job, "Restarts") == "1", show()

    # 3. What the job's own output says.
    assert "caught SIGUSR1" in text and f"requeueing job {job}" in text, show()
    first, second = text.split(f"job {job} restart 1:", 1)
    assert "latest committed iteration: none" in first
    assert re.search(r"--use-datastates\b.*--save-interval 1\b|--save-interval 1\b.*--use-datastates\b", first)
    m = re.search(r"latest committed iteration: (\d+)", second)
    assert m, show()
    resumed_from = int(m.group(1))
    assert resumed_from >= stopped_at >= 5
    assert f"[datastates] loaded iter_{resumed_from:07d}" in second, show()
    iterations = [int(x) for x in re.findall(r"^iteration\s+(\d+) \| loss", second, re.M)]
    assert iterations and iterations[0] == resumed_from + 1, show()
    assert iterations[-1] == TRAIN_ITERS
    # Bit-exact resume: an iteration logged by both runs has the same loss.
    before = dict(re.findall(r"^iteration\s+(\d+) \| loss (\S+)", first, re.M))
    after = dict(re.findall(r"^iteration\s+(\d+) \| loss (\S+)", second, re.M))
    common = set(before) & set(after)
    assert all(before[i] == after[i] for i in common), {i: (before[i], after[i]) for i in common}
    assert f"training step ended with exit code 0; latest committed iteration: {TRAIN_ITERS}" in second
    assert committed() == TRAIN_ITERS


def cluster_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
