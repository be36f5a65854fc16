"""Transformer Engine's pickled extra state through the adapter's load: checked before ``load_state_dict``.

megatron-core's local modules at the pin have no extra state, so ``te_extra_state_worker.py`` puts a
module with TE 2.9-2.11's ``get_extra_state``/``set_extra_state`` (which unpickles) into a real
megatron-core GPT and runs ``save_checkpoint``/``load_checkpoint`` of the adapter on a CPU rank.
"""

import subprocess
from pathlib import Path

import pytest

from helpers.procs import torchrun_command
from helpers.trainer_runs import REPO, trainer_env

pytest.importorskip("megatron.core")


@pytest.mark.multiproc
def test_extra_state_is_checked_before_the_model_loads(tmp_path):
    canary = tmp_path / "canary-touched-by-the-checkpoint"
    cmd = torchrun_command(1, str(Path(__file__).parent / "te_extra_state_worker.py"), str(tmp_path / "ckpt"),
                           str(canary))
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok: ") == 3, proc.stdout
    assert "decoder.layers.0.te_probe._extra_state" in proc.stdout and ".safetensors" in proc.stdout
    assert not canary.exists()
