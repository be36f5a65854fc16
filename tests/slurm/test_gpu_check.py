"""scripts/gpu_check.sh on a machine without a GPU: clear refusals, and the parts it would run.

The check itself runs only on a GPU node (docs/SLURM.md, "GPU node check"); here its arguments,
its exit status without CUDA, the timeouts and the shape of its results (via ``--device cpu``) are
tested, and its Megatron-LM part's driver (``megatron-ext main-job``) runs on CPU ranks in
tests/megatron/test_main_job.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,  # the tests' own: a worktree has no .venv
                               "SITE_ENV": str(tmp_path / "none.env"), "HOME": str(tmp_path),
                               "TMPDIR": str(tmp_path), **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer without CUDA")
def test_no_gpu_exits_2_in_one_line(tmp_path):
    prepared = tmp_path / "prepared"
    (prepared / "wheels").mkdir(parents=True)
    (prepared / "MANIFEST").write_text("")
    for args in ((), ("--from", str(prepared))):
        proc = _run(*args, "--out", str(tmp_path / "out"), tmp_path=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("gpu_check.sh: no CUDA: torch "), proc.stderr


def test_from_needs_a_prepared_folder(tmp_path):
    proc = _run("--from", str(tmp_path / "missing"), tmp_path=tmp_path)
    assert proc.returncode == 2 and "no prepared folder there" in proc.stderr, proc.stderr


def test_prepare_refuses_a_folder_git_does_not_ignore():
    """A prepared folder inside the checkout must be ignored: it travels as a carried path, not as the tree."""
    proc = subprocess.run(["bash", str(SCRIPT), "--prepare", "docs/gpu-check-here"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    try:
        assert proc.returncode == 2 and "not ignored by git" in proc.stderr, proc.stderr
    finally:
        (ROOT / "docs" / "gpu-check-here").rmdir()
    assert subprocess.run(["git", "check-ignore", "-q", ".gpu-check/"], cwd=ROOT).returncode == 0


def test_a_part_past_its_timeout_fails_and_the_results_stay_flat(tmp_path):
    """Each part runs under its timeout; the results folder holds at most 8 files and no folders (what
    the lent GPU machine's $OUT can bring back)."""
    out = tmp_path / "out"
    proc = _run("--device", "cpu", "--skip", "bench", "--skip", "megatron", tmp_path=tmp_path, OUT=str(out),
                GPU_CHECK_TIMEOUT_TESTS="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "FAIL tests" in summary and "timed out after 1s" in summary, summary
    assert "SKIP bench engine" in summary and "SKIP Megatron-LM" in summary, summary
    files = list(out.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in files), files
    assert {"summary.txt", "logs.tar.gz"} <= {f.name for f in files}


def test_bad_arguments_exit_2(tmp_path):
    for args, message in ((["--skip", "everything"], "--skip takes tests, bench or megatron"),
                          (["--wheels", str(tmp_path / "missing")], "is not a directory"),
                          (["--bogus"], "unknown argument --bogus")):
        proc = _run(*args, "--out", str(tmp_path / "out"), tmp_path=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_help_names_the_three_parts(tmp_path):
    proc = _run("--help", tmp_path=tmp_path)
    assert proc.returncode == 0
    for part in ("tests/gpu", "bench engine --device cuda --check", "pretrain_gpt.py", "--megatron-dir", "--wheels",
                 "--prepare DIR", "--from DIR", "--device cpu", "at most 8 files"):
        assert part in proc.stdout, part
