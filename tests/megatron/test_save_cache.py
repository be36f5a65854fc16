"""What a Megatron-LM save keeps for the next one (the optimizer's model-space leaves, the owned
split, the engine's plan) is reused only for the same exact structure, and every checkpoint holds
what an uncached save of that moment holds: before the first step, after it (Adam's moments
appear), a replaced optimizer tensor, a moment in a refused dtype, a parameter in new memory."""

import subprocess
from pathlib import Path

import pytest

from helpers.procs import torchrun_command
from helpers.trainer_runs import REPO, trainer_env

pytest.importorskip("megatron.core")


@pytest.mark.multiproc
def test_kept_structure_is_reused_only_when_exact():
    cmd = torchrun_command(1, str(Path(__file__).parent / "save_cache_worker.py"))
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "checkpoints exact" in proc.stdout
