"""Each benchmark declares its own ``megatron-ext bench`` subcommand, the CLI imports the benchmark
modules only for ``bench``, and a benchmark's temporary working directory never outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext import cli
from megatron_ext.bench.common import working_dir

REPO = Path(__file__).resolve().parents[2]


def test_every_bench_subcommand_runs_its_own_modules_main():
    for module in cli.bench_modules():
        args = cli.build_parser().parse_args(["bench", module.NAME])
        assert args.bench == module.NAME and args.func is module.main


def test_other_commands_import_no_benchmark():
    code = ("import sys; from megatron_ext import cli; cli.build_parser().parse_args(['verify', 'x']); "
            "print(' '.join(m for m in sys.modules if m.startswith('megatron_ext.bench')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


def test_a_given_working_directory_is_made_and_kept(tmp_path):
    given = tmp_path / "a" / "b"
    with working_dir(str(given), "unused-") as base:
        assert base == str(given) and given.is_dir()
    assert given.is_dir()


def test_a_temporary_working_directory_is_removed_even_on_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with working_dir(None, "megatron-ext-bench-test-") as base:
            assert os.path.dirname(base) == str(tmp_path) and os.path.isdir(base)
            open(os.path.join(base, "f"), "w").close()
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
