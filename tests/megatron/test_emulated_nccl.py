"""The CPU runs' ``nccl``: it refuses host tensors as NCCL does, and the engine's collectives pass it."""

import json
import subprocess
from pathlib import Path

from helpers.procs import torchrun_command
from megatron_ext.testing.megatron_lm import environment

WORKER = Path(__file__).with_name("emulated_nccl_worker.py")


def test_emulated_nccl_refuses_host_tensors_and_takes_device_ones(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(torchrun_command(2, str(WORKER), str(out)), env=environment(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "nccl"
    assert result["host_marked"] == [True, True, True, True]
    assert result["gpu_marked"] == [False] * 5  # incl. device=<a tensor>.device (Megatron's signal handler)
    assert result["refused"] == [True, True, True]
    assert result["gpu_sum"] == [2.0, 2.0, 2.0] and result["moved_sum"] == [1]
    assert result["objects"] == [{"rank": 0}, {"rank": 1}]
    assert result["gloo_sum"] == [1]  # explicit gloo groups still take host tensors
    assert result["collective_device"] == "cuda:0"  # the engine's choice for an NCCL world
    assert result["all_reduce_int"] == 2
