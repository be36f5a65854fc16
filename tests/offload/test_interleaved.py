"""The interleaved offload step on CPU: bit-identical to torch's AdamW for any split, and the
deferring stand-in for CUDA streams catches a missing wait."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.offload.interleaved import StateSlot, InterleavedUpdate, InterleavedOffload
from megatron_ext.offload.perf_model import NodeRates, Shape, choose, predict
from megatron_ext.offload.lanes import DeferredCpuLanes
from megatron_ext.offload.subgroups import ALIGN, partition, spread, strided

SIZES = [1000, 7, 4099, 64, 333]  # not multiples of the vector widths: cuts must not change rounding


def _groups(fused):
    return [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False,
                 foreach=None, capturable=False, differentiable=False, fused=fused, decoupled_weight_decay=True),
            dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
                 foreach=None, capturable=False, differentiable=False, fused=fused, decoupled_weight_decay=True)]


def _reference_and_slots(fused):
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in SIZES]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.AdamW([{"params": reference[:2], "weight_decay": 0.1},
                             {"params": reference[2:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    groups = _groups(fused)
    slots = [StateSlot(master=m.clone(), grad=torch.empty(n, dtype=torch.bfloat16), state={},
                      group=groups[0] if i < 2 else groups[1], weight=torch.empty(n, dtype=torch.bfloat16))
             for i, (m, n) in enumerate(zip(masters, SIZES))]
    return reference, opt, slots, gen


def _run(on_gpu_per_step, fused=True, streams=None, steps=4):
    reference, opt, slots, gen = _reference_and_slots(fused)
    engine = InterleavedUpdate(streams or DeferredCpuLanes(), subgroup_numel=1024)
    for step in range(steps):
        for p, slot in zip(reference, slots):
            grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            slot.grad.copy_(grad)
            p.grad = grad.float()
        opt.step()
        engine.step(slots, on_gpu_per_step(step, len(engine.plan(SIZES))))
        for p, slot in zip(reference, slots):
            if not torch.equal(p.detach(), slot.master):
                return False, f"master differs at step {step}"
            if not torch.equal(p.detach().to(torch.bfloat16), slot.weight):
                return False, f"weight differs at step {step}"
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if not torch.equal(opt.state[p][key], slot.state[key]):
                    return False, f"{key} differs at step {step}"
    return True, ""


def test_partition_covers_every_element_once_and_cuts_on_aligned_offsets():
    subgroups = partition(SIZES, 1000)
    seen = {t: [] for t in range(len(SIZES))}
    for sg in subgroups:
        assert sg.numel <= math.ceil(1000 / ALIGN) * ALIGN
        for p in sg.pieces:
            seen[p.tensor].append((p.start, p.stop))
            assert p.start % ALIGN == 0
    for t, ranges in seen.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == SIZES[t]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("fused", [True, None])
@pytest.mark.parametrize("split", ["cpu", "gpu", "half", "stride2", "stride3", "changing"])
def test_bit_identical_to_torch_adamw(fused, split):
    def on_gpu(step, total):
        return {"cpu": frozenset(), "gpu": frozenset(range(total)), "half": spread(total // 2, total),
                "stride2": strided(2, total), "stride3": strided(3, total),
                "changing": spread(step % (total + 1), total)}[split]
    ok, why = _run(on_gpu, fused=fused)
    assert ok, why


@pytest.mark.parametrize("label", ["grads_to_host", "prefetch", "buffer_free", "write_back", "weights_to_device"])
def test_a_missing_wait_is_caught(label):
    ok, _ = _run(lambda step, total: strided(2, total), streams=DeferredCpuLanes(drop_waits=(label,)))
    assert not ok, f"dropping the {label!r} wait went unnoticed"


def test_model_picks_the_fastest_split_and_respects_memory():
    shape = Shape(subgroups=10, subgroup_numel=1 << 20)
    fast_gpu = NodeRates(h2d=25e9, d2h=25e9, gpu_rate=5e10, cpu_rate=1e9, free_bytes=1e12)
    best = choose(fast_gpu, shape)
    assert 0 < best.gpu_subgroups <= 10
    assert best.seconds == min(predict(k, fast_gpu, shape).seconds for k in range(11))
    assert choose(NodeRates(25e9, 25e9, 5e10, 1e9, free_bytes=1e6), shape).gpu_subgroups == 0
    slow_link = NodeRates(h2d=1e6, d2h=1e6, gpu_rate=5e10, cpu_rate=1e9, free_bytes=1e12)
    assert choose(slow_link, shape).gpu_subgroups == 0


def test_model_driven_steps_log_the_split_and_stay_exact():
    lines = []
    rates = NodeRates(h2d=1e10, d2h=1e10, gpu_rate=1e9, cpu_rate=1e9, free_bytes=1e12)
    reference, opt, slots, gen = _reference_and_slots(True)
    offload = InterleavedOffload(DeferredCpuLanes(), 1024, policy="model", rates=rates, log=lines.append)
    for _ in range(3):
        for p, slot in zip(reference, slots):
            grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            slot.grad.copy_(grad)
            p.grad = grad.float()
        opt.step()
        offload.step(slots)
    assert all(torch.equal(p.detach(), slot.master) for p, slot in zip(reference, slots))
    assert len(lines) == 3 and "subgroups on the GPU, step predicted" in lines[0]
    assert offload.records[0].gpu_subgroups > 0


@pytest.mark.parametrize("momentum,nesterov", [(0.9, False), (0.9, True), (0.0, False)])
@pytest.mark.parametrize("split", ["cpu", "gpu", "stride2"])
def test_sgd_bit_identical_to_torch_sgd(momentum, nesterov, split):
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in SIZES]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.SGD(reference, lr=1e-2, momentum=momentum, nesterov=nesterov, weight_decay=0.01)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    slots = [StateSlot(m.clone(), torch.empty(n, dtype=torch.bfloat16), {}, group, torch.empty(n, dtype=torch.bfloat16))
             for m, n in zip(masters, SIZES)]
    engine = InterleavedUpdate(DeferredCpuLanes(), subgroup_numel=1024)
    total = len(engine.plan(SIZES))
    on_gpu = {"cpu": frozenset(), "gpu": frozenset(range(total)), "stride2": strided(2, total)}[split]
    for _ in range(4):
        for p, slot in zip(reference, slots):
            grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            slot.grad.copy_(grad)
            p.grad = grad.float()
        opt.step()
        engine.step(slots, on_gpu)
        for p, slot in zip(reference, slots):
            assert torch.equal(p.detach(), slot.master)
            assert torch.equal(p.detach().to(torch.bfloat16), slot.weight)
            if momentum:
                assert torch.equal(opt.state[p]["momentum_buffer"], slot.state["momentum_buffer"])
            else:
                assert slot.state == {}
