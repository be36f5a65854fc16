"""megatron-core GPT training on CPU ranks (gloo) through the reference trainer.

Each test launches ``megatron_ext.testing.reference_trainer`` with torchrun in a subprocess, reads the
per-iteration JSON log written by the logging rank and compares losses (bit for bit where the
test is about resumption).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers.trainer_runs import REPO, run_trainer, trainer_env  # noqa: E402


def run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter: the emulation is process-wide and must not leak."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=trainer_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_emulation_does_nothing_when_cuda_is_available():
    run_python(
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "before = torch.cuda.current_device\n"
        "from megatron_ext.testing.cpu_emulation import enable_cpu_emulation, "
        "is_cpu_emulation_enabled\n"
        "assert enable_cpu_emulation() is False and not is_cpu_emulation_enabled()\n"
        "from megatron_ext.megatron.cpu_device import enable_cpu_device\n"
        "assert enable_cpu_device() is False\n"
        "assert torch.cuda.current_device is before\n"
        "assert torch.ones(1).type() == 'torch.FloatTensor'\n"
    )


def test_cpu_device_alone_places_on_the_cpu_and_the_emulation_adds_cuda_type_names():
    # What ``megatron-ext convert`` switches on (product code), then the training emulation on top.
    run_python(
        "import torch\n"
        "from megatron_ext.megatron.cpu_device import enable_cpu_device\n"
        "assert enable_cpu_device() is True and enable_cpu_device() is True\n"
        "x = torch.zeros(2, device=torch.cuda.current_device())\n"
        "assert x.device.type == 'cpu' and x.cuda() is x and x.to('cuda').device.type == 'cpu'\n"
        "torch.cuda.synchronize()\n"
        "assert x.type() == 'torch.FloatTensor'\n"
        "from megatron_ext.testing.cpu_emulation import enable_cpu_emulation\n"
        "assert enable_cpu_emulation() is True and x.type() == 'torch.cuda.FloatTensor'\n"
    )


def test_emulation_maps_cuda_to_cpu_and_is_idempotent():
    run_python(
        "import torch\n"
        "from megatron_ext.testing.cpu_emulation import enable_cpu_emulation\n"
        "assert enable_cpu_emulation() is True and enable_cpu_emulation() is True\n"
        "x = torch.zeros(2, device='cuda')\n"
        "assert x.device.type == 'cpu' and x.cuda() is x\n"
        "assert torch.empty(1, device=torch.cuda.current_device()).device.type == 'cpu'\n"
        "assert x.to('cuda').device.type == 'cpu'\n"
        "assert torch.ones(1, dtype=torch.bfloat16).type() == 'torch.cuda.BFloat16Tensor'\n"
        "assert torch.ones(1, dtype=torch.int64).type() == 'torch.LongTensor'\n"
        "torch.cuda.manual_seed(3); a = torch.cuda.get_rng_state(); r1 = torch.rand(3)\n"
        "torch.cuda.set_rng_state(a); assert torch.equal(torch.rand(3), r1)\n"
    )


def losses_by_iteration(records: list[dict]) -> dict[int, str]:
    return {r["iteration"]: r["loss"] for r in records}


@pytest.mark.multiproc
def test_tp2_pp2_dp2_trains_with_falling_loss(tmp_path):
    records = run_trainer(8, ["--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--train-iters", "10"],
                          tmp_path / "log.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, 11))
    losses = [float.fromhex(r["loss"]) for r in records]
    assert 5.0 < losses[0] < 6.0, losses  # about ln(256) before training
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses


@pytest.mark.multiproc
@pytest.mark.slow  # the reference trainer's own oracle; Megatron-LM's torch_dist is the default-run oracle
def test_torch_dist_resume_is_bit_exact_tp2_dp2(tmp_path):
    parallel = ["--tensor-model-parallel-size", "2", "--train-iters", "6"]
    reference = losses_by_iteration(run_trainer(4, parallel, tmp_path / "reference.jsonl"))
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    ckpt = tmp_path / "ckpt"
    first = run_trainer(4, [*parallel, "--save", str(ckpt), "--save-interval", "1",
                            "--exit-interval", "3"], tmp_path / "first.jsonl")
    assert [r["iteration"] for r in first] == [1, 2, 3]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [
        "iter_0000001", "iter_0000002", "iter_0000003"]
    assert (ckpt / "iter_0000003" / "metadata.json").exists()
    assert not list(ckpt.glob(".*tmp*"))

    resumed = losses_by_iteration(run_trainer(4, [*parallel, "--load", str(ckpt)],
                                              tmp_path / "resumed.jsonl"))
    assert sorted(resumed) == [4, 5, 6]
    for iteration in (4, 5, 6):
        assert resumed[iteration] == reference[iteration], (iteration, resumed, reference)
