"""scripts/gpu_check.sh on a machine without a GPU: clear refusals, and the parts it would run.

The check itself runs only on a GPU node (docs/SLURM.md); here its arguments and its exit status
without CUDA are tested, and its Megatron-LM part's driver (``megatron-ext main-job``) runs on CPU
ranks in tests/megatron/test_main_job.py.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,  # the tests' own: a worktree has no .venv
                               "SITE_ENV": str(tmp_path / "none.env"), "HOME": str(tmp_path)})


def test_no_gpu_exits_2_and_says_why(tmp_path):
    proc = _run("--out", str(tmp_path / "out"), tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sees no CUDA device" in proc.stdout + proc.stderr


def test_bad_arguments_exit_2(tmp_path):
    for args, message in ((["--skip", "everything"], "--skip takes tests, bench or megatron"),
                          (["--wheels", str(tmp_path / "missing")], "is not a directory"),
                          (["--bogus"], "unknown argument --bogus")):
        proc = _run(*args, "--out", str(tmp_path / "out"), tmp_path=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_help_names_the_three_parts(tmp_path):
    proc = _run("--help", tmp_path=tmp_path)
    assert proc.returncode == 0
    for part in ("tests/gpu", "bench engine --device cuda", "pretrain_gpt.py", "--megatron-dir", "--wheels"):
        assert part in proc.stdout, part
