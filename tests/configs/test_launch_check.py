"""``scripts/launch.sh --check``, the preflight a new cluster user runs (and ``scripts/slurm_submit.sh``
runs before every submission), on the login node, without an allocation: the Megatron-LM checkout
at the pin with the patches applied, imports under SITE_SETUP, Transformer Engine or
TRANSFORMER_IMPL=local, data that exists or mock data asked for, no placeholder left. No Slurm needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.testing.megatron_lm import PIN

from helpers.megatron_lm_runs import checkout_or_skip

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch.sh"
SUBMIT = REPO / "scripts" / "slurm_submit.sh"


def _site(tmp_path: Path, checkout: Path | str, **settings: str) -> Path:
    values = {"MEGATRON_LM_DIR": str(checkout), "CKPT_ROOT": str(tmp_path / "lustre"),
              "LOCAL_SCRATCH": str(tmp_path / "scratch"), "PYTHON": sys.executable,
              "SITE_SETUP": f"export PYTHONPATH={REPO}", "MEGATRON_EXT_DIR": str(REPO), **settings}
    site = tmp_path / "site.env"
    site.write_text("".join(f"{k}={_quote(v)}\n" for k, v in values.items()))
    return site


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def _env(site: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_")) and k not in (
               "MODEL_CONFIG", "TRAINER", "MEGATRON_ENTRY", "MEGATRON_DATA_ARGS", "EXTRA_TRAINER_ARGS", "MOCK_DATA",
               "TRANSFORMER_IMPL", "MEGATRON_LM_DIR", "PYTHONPATH")}
    env.update(SITE_ENV=str(site), **extra)
    return env


def check(site: Path, config: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAUNCH), "--config", config, "--check"], env=_env(site, **extra),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkout():
    return checkout_or_skip()


def _lines(res: subprocess.CompletedProcess, kind: str) -> list[str]:
    return [line.split(kind, 1)[1].strip() for line in res.stdout.splitlines() if f"check: {kind}" in line]


def test_a_ready_site_passes(tmp_path, checkout):
    res = check(_site(tmp_path, checkout), "cpu_tiny_megatron")
    assert res.returncode == 0, res.stdout + res.stderr
    ok = "\n".join(_lines(res, "ok"))
    assert "at the pin with the megatron_ext patches applied" in ok
    assert f"megatron_ext imports under SITE_SETUP with {sys.executable} (from {REPO})" in ok
    assert "megatron.core imports" in ok and "--transformer-impl local: Transformer Engine not needed" in ok
    assert "data: MEGATRON_DATA_ARGS: --mock-data" in ok and "can be created" in ok
    assert res.stdout.rstrip().endswith("launch.sh: check: all ok")


def test_no_transformer_engine_and_no_data_are_named_with_the_fix(tmp_path, checkout):
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed here")
    except ImportError:
        pass
    site = _site(tmp_path, checkout)
    res = check(site, "gpt_7b")
    assert res.returncode == 2, res.stdout
    failed = _lines(res, "FAIL")
    assert any("Transformer Engine does not import under SITE_SETUP" in f and "TRANSFORMER_IMPL=local" in f
               for f in failed), failed
    assert any(f.startswith("data: NOT SET: set MEGATRON_DATA_ARGS") and "MOCK_DATA=1" in f for f in failed), failed
    assert "docs/SLURM.md" in res.stderr
    fixed = check(site, "gpt_7b", TRANSFORMER_IMPL="local", MOCK_DATA="1")
    assert fixed.returncode == 0, fixed.stdout
    # The dry run shows what the job gets: the implementation and where its data comes from.
    dry = subprocess.run([str(LAUNCH), "--config", "gpt_7b", "--dry-run", "--nodes", "2"],
                         env=_env(site, TRANSFORMER_IMPL="local"), capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "# transformer: --transformer-impl local" in dry.stdout and "# data: NOT SET" in dry.stdout
    assert "--transformer-impl local " in dry.stdout.splitlines()[-1]


def test_data_paths_are_checked(tmp_path, checkout):
    (tmp_path / "data").mkdir()
    for suffix in (".bin", ".idx"):
        (tmp_path / "data" / f"text_document{suffix}").write_bytes(b"")
    (tmp_path / "vocab.json").write_text("{}")
    good = (f"--data-path 0.7 {tmp_path}/data/text_document 0.3 {tmp_path}/data/text_document "
            f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/vocab.json --merge-file {tmp_path}/vocab.json")
    bad = f"--data-path {tmp_path}/data/missing_document --tokenizer-type GPT2BPETokenizer --vocab-file /nonexistent/v.json"
    env = dict(TRANSFORMER_IMPL="local")
    res = check(_site(tmp_path, checkout, MEGATRON_DATA_ARGS=good), "gpt_7b", **env)
    assert res.returncode == 0, res.stdout
    res = check(_site(tmp_path, checkout, MEGATRON_DATA_ARGS=bad), "gpt_7b", **env)
    assert res.returncode == 2
    failed = _lines(res, "FAIL")
    assert f"data: --data-path {tmp_path}/data/missing_document: no {tmp_path}/data/missing_document.bin and " \
           f"{tmp_path}/data/missing_document.idx (nor a file {tmp_path}/data/missing_document)" in failed
    assert "data: --vocab-file /nonexistent/v.json: does not exist" in failed
    res = check(_site(tmp_path, checkout, MEGATRON_DATA_ARGS=good, MOCK_DATA="1"), "gpt_7b", **env)
    assert res.returncode == 2 and "contradict each other" in res.stderr


def test_the_checkout_must_be_the_patched_pin(tmp_path, checkout):
    other = tmp_path / "other"
    other.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "init", "-q", str(other)], check=True)
    (other / "pretrain_gpt.py").write_text("")
    subprocess.run([*git, "-C", str(other), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(other), "commit", "-qm", "x"], check=True)
    res = check(_site(tmp_path, other), "cpu_tiny_megatron")
    assert res.returncode == 2
    assert any("is at commit" in f and PIN in f for f in _lines(res, "FAIL"))

    clean = tmp_path / "clean"  # the pin itself, unpatched: a shared clone of the cached checkout
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(checkout), str(clean)], check=True)
    subprocess.run(["git", "-C", str(clean), "-c", "advice.detachedHead=false", "checkout", "-q",
                    PIN], check=True)
    res = check(_site(tmp_path, clean), "cpu_tiny_megatron")
    assert res.returncode == 2
    assert f"MEGATRON_LM_DIR={clean} is at the pin but not patched: run scripts/apply_patches.sh {clean}" in \
        _lines(res, "FAIL")
    shutil.rmtree(clean)


def test_megatron_ext_must_import_on_the_nodes(tmp_path, checkout):
    bare = tmp_path / "bare-python"  # an interpreter without this project's packages (isolated, no site)
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    res = check(_site(tmp_path, checkout, SITE_SETUP="true", PYTHON=str(bare)), "cpu_tiny")
    assert res.returncode == 2
    assert any(f.startswith(f"megatron_ext does not import under SITE_SETUP with PYTHON={bare}")
               and "No module named 'megatron_ext'" in f and f"pip install -e {REPO}" in f
               for f in _lines(res, "FAIL")), res.stdout


@pytest.mark.parametrize("setting", ['SITE_SETUP=module load cuda; source /path/to/venv/bin/activate',
                                     "MEGATRON_DATA_ARGS=--data-path <dataset>"])
def test_placeholders_are_refused_everywhere(tmp_path, checkout, setting):
    key, value = setting.split("=", 1)
    site = _site(tmp_path, checkout, **{key: value})
    for mode in (["--check"], ["--dry-run", "--nodes", "1"]):
        res = subprocess.run([str(LAUNCH), "--config", "gpt_7b", *mode], env=_env(site),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and f"site config still has a placeholder: {key}=" in res.stderr, res.stderr


def test_submission_runs_the_check_first(tmp_path, checkout):
    site = _site(tmp_path, checkout)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\necho \"sbatch $*\"\n")
    (fake / "sbatch").chmod(0o755)
    env = _env(site, PATH=f"{fake}:{os.environ['PATH']}")
    refused = subprocess.run([str(SUBMIT), "gpt_7b"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "the preflight failed" in refused.stderr and "sbatch " not in refused.stdout
    ok = subprocess.run([str(SUBMIT), "cpu_tiny_megatron", "--nodes=1"], env=env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "launch.sh: check: all ok" in ok.stdout and "sbatch --nodes=1 " in ok.stdout
