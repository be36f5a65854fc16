"""What a training job installs: the engine and both adapters import without the command line's and
the benchmarks' packages (psutil, tqdm), and the package does not require them."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINING_MODULES = ("megatron_ext.engine", "megatron_ext.megatron.checkpointing", "megatron_ext.deepspeed_adapter",
                    "datastates")
CLI_ONLY = ("psutil", "tqdm")


def test_install_requires_leaves_cli_and_bench_packages_to_extras():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    required = [line.split(">")[0].split("=")[0].strip() for line in cfg["options"]["install_requires"].splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert not set(CLI_ONLY) & set(required), required
    extras = cfg["options.extras_require"]
    for name in CLI_ONLY:
        assert name in extras["cli"], f"the cli extra lacks {name}"


def test_training_modules_import_without_psutil_and_tqdm():
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in CLI_ONLY)  # import raises ImportError
    code = f"import sys; {blocked}; " + "; ".join(f"import {m}" for m in TRAINING_MODULES)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
