"""Real Megatron-LM arguments round-trip through the checkpoint under the strict allow-list.

Parses a typical GPT command line (``--bf16``, distributed optimizer) with the pinned Megatron-LM
checkout's own ``parse_args`` and ``validate_args``, stores the args as the Megatron adapter does
(``checkpoint_layout.storable_args``), and loads them back: every value returns equal and of the same type (plain
values, ``torch.dtype``, ``AttnBackend``, ``signal.Signals``), and a loader without the Megatron
list refuses the two enums rather than rebuilding them. Runs in a child process (Megatron keeps
global state) and needs the checkout (scripts/fetch_megatron.sh) plus what ``megatron/training``
imports (requirements/megatron-lm.txt).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import REPO

from megatron_ext.testing.megatron_lm import cache_dir

CHECKOUT = cache_dir()

CODE = r"""
import sys
sys.argv = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "10", "--bf16", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "1000", "--mock-data", "--save", "/tmp/x", "--load", "/tmp/x",
            "--save-interval", "1", "--use-distributed-optimizer", "--distributed-backend", "gloo",
            "--transformer-impl", "local", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]
from megatron.training.arguments import parse_args, validate_args
args = parse_args()
args.rank, args.world_size = 0, 1
validate_args(args, {})
from megatron_ext.engine import UnsafeCheckpointError
from megatron_ext.engine.format import codec
from megatron_ext.megatron.checkpoint_layout import storable_args
from megatron_ext.megatron.safe_classes import megatron_classes
stored = storable_args(args)
encoder = codec.Encoder(classes=megatron_classes())
skeleton = encoder.encode(stored)
back = codec.decode(skeleton, lambda name: None, classes=megatron_classes())
kinds = set()
for key, value in vars(args).items():
    got = getattr(back, key)
    assert type(got) is type(value) and got == value, (key, value, got)
    kinds.add(f"{type(value).__module__}.{type(value).__qualname__}")
try:
    codec.decode(skeleton, lambda name: None)
except UnsafeCheckpointError as exc:
    refused = str(exc)
print(sorted(kinds))
print(refused)
"""


@pytest.mark.skipif(not (CHECKOUT / "megatron" / "training" / "arguments.py").exists(),
                    reason=f"no Megatron-LM checkout at {CHECKOUT} (scripts/fetch_megatron.sh)")
def test_real_megatron_args_round_trip():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(CHECKOUT), str(REPO)]))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", CODE], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(REPO))
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        pytest.skip("megatron/training needs requirements/megatron-lm.txt: " + proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    kinds, refused = proc.stdout.strip().splitlines()[-2:]
    assert "megatron.core.transformer.enums.AttnBackend" in kinds and "signal.Signals" in kinds
    assert "torch.dtype" in kinds
    assert "which this loader does not allow" in refused
