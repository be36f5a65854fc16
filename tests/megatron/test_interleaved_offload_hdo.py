"""``--datastates-interleaved-offload``: megatron-core's hybrid device optimizer (HDO) subclassed so its
step is the interleaved one; bit-identical to HDO at fraction 1.0, and their state dicts load into
each other. Built on CPU tensors under the harness's emulation, in a fresh interpreter (as
``test_cpu_offload``); ``tests/megatron_lm/test_interleaved_offload.py`` runs it in Megatron-LM's loop.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers.trainer_runs import REPO, trainer_env  # noqa: E402

SETUP = """
import copy
import torch
from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
enable_cpu_emulation()
from megatron_ext.testing import megatron_lm
megatron_lm._patch_cuda_queries()
megatron_lm._hybrid_optimizer_on_cpu()
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron_ext.megatron.interleaved_offload import InterleavedOffloadOptimizer

InterleavedOffloadOptimizer.subgroup_numel = 128  # several subgroups, some spanning shards

def build(cls, seed=0, sgd=False):
    torch.manual_seed(seed)
    shards = [torch.randn(n, dtype=torch.bfloat16) for n in (300, 70, 129, 5)]
    inner = (dict(cpu_optimizer_cls=torch.optim.SGD, gpu_optimizer_cls=torch.optim.SGD, momentum=0.9) if sgd else
             dict(cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW, betas=(0.9, 0.95), eps=1e-8,
                  fused=True))
    opt = cls([{"params": shards[:2]}, {"params": shards[2:], "weight_decay": 0.0}], offload_fraction=1.0,
              param_update_in_fp32=True, lr=1e-2, weight_decay=0.1, **inner)
    return shards, opt

def step(shards, opt, i):
    gen = torch.Generator().manual_seed(100 + i)
    for s in shards:
        s.decoupled_grad = torch.randn(s.shape, generator=gen).to(torch.bfloat16)
    opt.step()

def same(a, b, keys=("exp_avg", "exp_avg_sq", "step", "master_param")):
    (sa, oa), (sb, ob) = a, b
    assert all(torch.equal(x, y) for x, y in zip(sa, sb)), "weights differ"
    for p, q in zip(sa, sb):
        for key in keys:
            assert torch.equal(oa.state[p][key], ob.state[q][key]), key
"""


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SETUP + code], cwd=REPO, env=trainer_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_bit_identical_to_hdo_and_state_dicts_interchange():
    out = run_python("""
hdo, ours = build(HybridDeviceOptimizer), build(InterleavedOffloadOptimizer)
assert ours[1].gpu_optimizer is None and len(ours[1]._slots()) == 0
for i in range(4):
    step(*hdo, i); step(*ours, i)
    same(hdo, ours)
# the splits the model chose on the way, then a resume each way across the flag
print(len(ours[1]._offload.records), sorted({r.gpu_subgroups for r in ours[1]._offload.records}))
for source, target_cls in ((hdo, InterleavedOffloadOptimizer), (ours, HybridDeviceOptimizer)):
    target = build(target_cls, seed=1)
    for t, s in zip(target[0], source[0]):
        t.copy_(s)
    target[1].load_state_dict(copy.deepcopy(source[1].state_dict()))  # a load may keep the given tensors
    reference = build(type(source[1]), seed=1)
    for t, s in zip(reference[0], source[0]):
        t.copy_(s)
    reference[1].load_state_dict(copy.deepcopy(source[1].state_dict()))
    for i in range(4, 7):
        step(*target, i); step(*reference, i)
        same(target, reference)
print("ok")
""")
    assert out.split()[-1] == "ok", out
    assert out.split()[0] == "4"


def test_sgd_bit_identical_to_hdo():
    out = run_python("""
hdo, ours = build(HybridDeviceOptimizer, sgd=True), build(InterleavedOffloadOptimizer, sgd=True)
for i in range(4):
    step(*hdo, i); step(*ours, i)
    same(hdo, ours, keys=("momentum_buffer", "master_param"))
print("ok")
""")
    assert out.split()[-1] == "ok", out


def test_the_flag_is_refused_without_cpu_offload_and_with_a_fraction():
    from megatron_ext.megatron.args import validate_datastates_args

    base = dict(datastates_interleaved_offload=True, optimizer="adam", use_datastates=False)
    with pytest.raises(ValueError, match="needs --optimizer-cpu-offload"):
        validate_datastates_args(argparse.Namespace(**base, optimizer_cpu_offload=False,
                                                    optimizer_offload_fraction=1.0))
    with pytest.raises(ValueError, match="drop --optimizer-offload-fraction 0.5"):
        validate_datastates_args(argparse.Namespace(**base, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5))
    with pytest.raises(ValueError, match="must be positive, not 0"):
        validate_datastates_args(argparse.Namespace(**base, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                                    datastates_offload_subgroup_numel=0))
    with pytest.raises(ValueError, match="Adam/AdamW and SGD, not --optimizer lion"):
        validate_datastates_args(argparse.Namespace(**{**base, "optimizer": "lion"}, optimizer_cpu_offload=True,
                                                    optimizer_offload_fraction=1.0))
