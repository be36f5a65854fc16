"""The DeepSpeed adapter's allow-list is exactly the classes real DeepSpeed checkpoints hold.

Saves real checkpoints with DeepSpeed's own engine (2 CPU ranks, 2 steps) for ZeRO 0-3, fp32,
bf16 and fp16 (fp16 through ``fp16_on_cpu.py``), with and without the WarmupLR scheduler, walks
every object in every ``.pt`` file, and compares the classes found (beyond plain values, tensors
and what the codec tags natively) with ``DEEPSPEED_SAFE_CLASSES``. Then the same configurations
save and load through ``datastates_ckpt``, which only works if the list suffices.
"""

from __future__ import annotations

import collections
import enum
import itertools
from pathlib import Path

import pytest
import torch

from megatron_ext.deepspeed_adapter import DEEPSPEED_SAFE_CLASSES

from test_deepspeed_resume import run_harness  # noqa: E402

HERE = Path(__file__).resolve().parent
NATIVE = (bool, int, float, str, bytes, type(None), dict, list, tuple, set, frozenset, collections.OrderedDict,
          torch.Size, torch.dtype)


def _classes(value, found: set[str], seen: set[int]) -> None:
    """Names of the classes, other than natively encoded ones, anywhere inside ``value``."""
    if id(value) in seen or isinstance(value, torch.Tensor):
        return
    seen.add(id(value))
    cls = type(value)
    if cls not in NATIVE:
        found.add(f"{cls.__module__}.{cls.__qualname__}")
    if isinstance(value, dict):
        for k, v in value.items():
            _classes(k, found, seen)
            _classes(v, found, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _classes(v, found, seen)
    elif not isinstance(value, enum.Enum) and hasattr(value, "__dict__"):
        for v in vars(value).values():
            _classes(v, found, seen)


CONFIGS = list(itertools.product([0, 1, 2, 3], ["fp32", "bf16", "fp16"], [False, True]))


@pytest.mark.multiproc
@pytest.mark.slow
def test_shipped_list_is_what_deepspeed_checkpoints_hold(tmp_path):
    found: set[str] = set()
    for zero, dtype, scheduler in CONFIGS:
        config = ["--zero-stage", str(zero), "--dtype", dtype, *(["--scheduler"] if scheduler else [])]
        script = HERE / "fp16_on_cpu.py" if dtype == "fp16" else None
        name = f"z{zero}-{dtype}-{'sched' if scheduler else 'nosched'}"
        own = tmp_path / name
        run_harness([*config, "--engine", "torch", "--steps", "2", "--save-dir", str(own)],
                    tmp_path / f"{name}.jsonl", script=script)
        files = sorted(own.rglob("*.pt"))
        assert files, f"{own}: DeepSpeed saved nothing"
        for path in files:
            _classes(torch.load(path, map_location="cpu", weights_only=False), found, set())
        # The adapter saves and loads the same configuration with the shipped list alone.
        ours = tmp_path / f"ds-{name}"
        run_harness([*config, "--engine", "datastates", "--steps", "2", "--save-dir", str(ours)],
                    tmp_path / f"ds-{name}.jsonl", script=script)
        resumed = run_harness([*config, "--engine", "datastates", "--steps", "3", "--save-dir", str(ours), "--load"],
                              tmp_path / f"ds-{name}-resumed.jsonl", script=script)
        assert resumed and resumed[-1]["step"] == 3
    assert found == set(DEEPSPEED_SAFE_CLASSES)
