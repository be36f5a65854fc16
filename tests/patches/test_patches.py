"""The Megatron-LM patch series and its scripts.

CI has no Megatron-LM checkout (only megatron-core from PyPI), so the checks against the real
pinned commit run when MEGATRON_LM_DIR points at a checkout that contains it; the rest runs
everywhere: series shape, what the series touches, the scripts' refusals, and flag validation.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch"))
from megatron_ext.testing.megatron_lm import PIN, PIN_TAG


def _touched(patch: pathlib.Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), flags=re.M)


def test_series_is_numbered_format_patch_with_messages():
    assert [p.name[:4] for p in PATCHES] == [f"{i:04d}" for i in range(1, len(PATCHES) + 1)]
    for patch in PATCHES:
        text = patch.read_text()
        assert text.startswith("From "), patch.name
        subject = re.search(r"^Subject: \[PATCH[^\]]*\] (.+)$", text, flags=re.M)
        assert subject and subject.group(1).startswith("datastates:"), patch.name
        body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
        assert len(body.split()) >= 15, f"{patch.name}: the message must say why"


def test_series_only_reroutes_to_megatron_ext():
    added = []
    for patch in PATCHES:
        for path in _touched(patch):
            assert path.startswith("megatron/"), path
        added += [line[1:] for line in patch.read_text().splitlines()
                  if line.startswith("+") and not line.startswith("+++")]
    code = [line for line in added if line.strip() and not line.strip().startswith(("#", '"""'))]
    assert len(code) < 60, "patches should stay a few lines per hook point"
    assert any("megatron_ext" in line for line in code)


def test_patches_touching_megatron_core_apply_to_installed_package(tmp_path):
    import megatron.core

    site = pathlib.Path(megatron.core.__file__).resolve().parents[2]
    core_patches = [p for p in PATCHES if any(t.startswith("megatron/core/") for t in _touched(p))]
    for patch in core_patches:
        for path in _touched(patch):
            dst = tmp_path / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(site / path, dst)
        subprocess.run(["git", "apply", "--check", "--include=megatron/core/*", str(patch)], cwd=tmp_path, check=True)
    # The series re-routes from megatron/training only; megatron-core stays untouched.
    assert core_patches == []


def _run(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_apply_refuses_another_commit(tmp_path):
    repo = tmp_path / "Megatron-LM"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("x")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], check=True)
    before = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    result = _run("apply_patches.sh", str(repo))
    assert result.returncode != 0
    assert f"but the patches are for {PIN_TAG} ({PIN})" in result.stderr
    assert subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout == before


def test_apply_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    result = _run("apply_patches.sh", str(tmp_path))
    assert result.returncode != 0 and "is not a git checkout of Megatron-LM" in result.stderr


def test_apply_reports_a_failed_clone_without_network(tmp_path):
    env = dict(os.environ, MEGATRON_LM_URL=str(tmp_path / "no-such-repo"))
    result = _run("apply_patches.sh", str(tmp_path / "Megatron-LM"), env=env)
    assert result.returncode != 0 and "could not clone" in result.stderr
    assert not (tmp_path / "Megatron-LM").exists()


def test_scripts_need_git(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "ls", "cat"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    result = _run("apply_patches.sh", str(tmp_path), env={"PATH": str(bindir)})
    assert result.returncode != 0 and "git is not installed" in result.stderr


@pytest.fixture(scope="module")
def pinned_source() -> str:
    """A git repository holding the pin: MEGATRON_LM_DIR, else the cached checkout fetch_megatron.sh made."""
    if os.environ.get("MEGATRON_LM_DIR"):
        return os.environ["MEGATRON_LM_DIR"]
    from megatron_ext.testing.megatron_lm import find_checkout

    checkout, reason = find_checkout()
    if checkout is None:
        pytest.skip(reason)
    return str(checkout)


def test_against_the_pinned_checkout(tmp_path, pinned_source):
    """Apply, apply again (no-op), refuse a dirty tree, remove: on a real clone at the pin."""
    clone = tmp_path / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--no-checkout", pinned_source, str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", PIN], check=True)
    first = _run("apply_patches.sh", str(clone))
    assert first.returncode == 0, first.stderr
    assert f"applied {len(PATCHES)} patches" in first.stdout
    second = _run("apply_patches.sh", str(clone))
    assert second.returncode == 0 and "already applied" in second.stdout
    removed = _run("remove_patches.sh", str(clone))
    assert removed.returncode == 0, removed.stderr
    assert subprocess.run(["git", "-C", str(clone), "status", "--porcelain"], capture_output=True,
                          text=True).stdout == ""
    (clone / "megatron" / "training" / "training.py").write_text("changed\n")
    dirty = _run("apply_patches.sh", str(clone))
    assert dirty.returncode != 0 and "uncommitted changes" in dirty.stderr
    check = _run("check_patches.sh", pinned_source)
    assert check.returncode == 0, check.stdout + check.stderr


def test_fetch_megatron_makes_and_keeps_a_patched_checkout(tmp_path, pinned_source):
    """From a local repository (no network): verified pin, the series applied, re-patched when touched."""
    env = dict(os.environ, MEGATRON_LM_DIR=pinned_source, MEGATRON_EXT_CACHE=str(tmp_path / "cache"))
    first = _run("fetch_megatron.sh", env=env)
    assert first.returncode == 0, first.stderr
    checkout = pathlib.Path(first.stdout.strip().splitlines()[-1])
    assert checkout == tmp_path / "cache" / f"Megatron-LM-{PIN[:7]}"
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert head.strip() == PIN
    patched = (checkout / "megatron" / "training" / "checkpointing.py").read_text()
    assert "megatron_ext.megatron import checkpointing as datastates" in patched
    again = _run("fetch_megatron.sh", env=env)
    assert again.returncode == 0 and "applied" not in again.stderr  # nothing to do
    (checkout / "megatron" / "training" / "checkpointing.py").write_text("edited\n")
    repaired = _run("fetch_megatron.sh", env=env)
    assert repaired.returncode == 0 and "applied" in repaired.stderr
    assert (checkout / "megatron" / "training" / "checkpointing.py").read_text() == patched


def test_fetch_megatron_refuses_a_repository_without_the_pin(tmp_path):
    repo = tmp_path / "other"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = dict(os.environ, MEGATRON_LM_DIR=str(repo), MEGATRON_EXT_CACHE=str(tmp_path / "cache"))
    result = _run("fetch_megatron.sh", env=env)
    assert result.returncode != 0 and f"does not contain commit {PIN}" in result.stderr
    assert not (tmp_path / "cache" / f"Megatron-LM-{PIN[:7]}").exists()


# ------------------------------------------------------------------ flag validation
def _args(*argv: str) -> argparse.Namespace:
    from megatron_ext.megatron.args import add_datastates_args

    parser = add_datastates_args(argparse.ArgumentParser())
    parser.add_argument("--save")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--ckpt-format", default="torch_dist")
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("extra, message", [
    (["--async-save"], "--use-datastates replaces --async-save"),
    (["--ckpt-format", "torch"], "needs the default --ckpt-format torch_dist, not torch"),
    (["--datastates-host-cache-size", "-1"], "host_cache_size must be > 0 GiB"),
    (["--datastates-timeout", "0"], "persist_timeout_s must be > 0 seconds"),
    (["--datastates-overload-policy", "supersede", "--datastates-max-durable-age", "-2"],
     "max_durable_age must be a whole number >= 0"),
])
def test_conflicting_flags_are_one_clear_error(tmp_path, extra, message):
    from megatron_ext.megatron.args import validate_datastates_args

    with pytest.raises(ValueError, match=re.escape(message)):
        validate_datastates_args(_args("--use-datastates", "--save", str(tmp_path), *extra))


def test_missing_save_and_unwritable_local_dir(tmp_path):
    from megatron_ext.megatron.args import validate_datastates_args

    with pytest.raises(ValueError, match="needs --save"):
        validate_datastates_args(_args("--use-datastates"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="local_dir .* is not writable"):
        validate_datastates_args(_args("--use-datastates", "--save", str(tmp_path / "save"),
                                       "--datastates-local-dir", str(blocker / "sub")))


def test_overload_flags_reach_the_engine_config(tmp_path):
    from megatron_ext.megatron.args import engine_config_from_args

    cfg = engine_config_from_args(_args("--use-datastates", "--save", str(tmp_path),
                                        "--datastates-overload-policy", "supersede",
                                        "--datastates-max-durable-age", "4"))
    assert cfg["overload_policy"] == "supersede" and cfg["max_durable_age"] == 4
    assert "overload_policy" not in engine_config_from_args(_args("--use-datastates", "--save", str(tmp_path)))


def test_restore_threads_flag_reaches_the_engine_config_and_is_checked(tmp_path):
    from megatron_ext.megatron.args import engine_config_from_args, validate_datastates_args

    args = _args("--use-datastates", "--save", str(tmp_path), "--datastates-restore-threads", "2")
    assert engine_config_from_args(args)["restore_threads"] == 2
    assert "restore_threads" not in engine_config_from_args(_args("--use-datastates", "--save", str(tmp_path)))
    with pytest.raises(ValueError, match="restore_threads must be a whole number in \\[1, 64\\], got 0"):
        validate_datastates_args(_args("--use-datastates", "--save", str(tmp_path), "--datastates-restore-threads", "0"))


def test_without_the_flag_nothing_is_checked():
    from megatron_ext.megatron.args import validate_datastates_args

    validate_datastates_args(_args("--async-save", "--ckpt-format", "torch"))
