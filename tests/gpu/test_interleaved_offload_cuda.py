"""The interleaved offload's CUDA path (skipped without CUDA): every subgroup on the GPU gives torch's fused
AdamW on the device bit for bit, none on the GPU gives it on the host, and a model-chosen split keeps
host state pinned and the step's write-backs complete when it returns."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.offload.interleaved import StateSlot, InterleavedUpdate, InterleavedOffload, init_state
from megatron_ext.offload.lanes import CudaLanes

SIZES = [1 << 20, 4099, 3 << 18, 7]
GROUP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, foreach=None,
             capturable=False, differentiable=False, fused=True, decoupled_weight_decay=True)


def _setup(reference_device):
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in SIZES]
    reference = [torch.nn.Parameter(m.to(reference_device)) for m in masters]
    opt = torch.optim.AdamW(reference, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    slots = [StateSlot(m.pin_memory(), torch.empty(n, dtype=torch.bfloat16, device="cuda"), init_state(m, GROUP, True),
                      GROUP, torch.empty(n, dtype=torch.bfloat16, device="cuda")) for m, n in zip(masters, SIZES)]
    return reference, opt, slots


def _grads(slots, reference, step):
    gen = torch.Generator(device="cuda").manual_seed(step)
    for i, slot in enumerate(slots):
        slot.grad.copy_(torch.randn(slot.grad.shape, generator=gen, device="cuda").to(torch.bfloat16))
        if reference:
            reference[i].grad = slot.grad.float().to(reference[i].device)


@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_all_on_one_side_matches_torch_fused_adamw_there(where):
    reference, opt, slots = _setup(where)
    engine = InterleavedUpdate(CudaLanes(torch.device("cuda", torch.cuda.current_device())), subgroup_numel=1 << 18)
    for step in range(3):
        _grads(slots, reference, step)
        opt.step()
        total = len(engine.plan(SIZES))
        engine.step(slots, frozenset(range(total)) if where == "cuda" else frozenset())
        for p, slot in zip(reference, slots):
            assert torch.equal(p.detach().cpu(), slot.master)
            assert torch.equal(opt.state[p]["exp_avg_sq"].cpu(), slot.state["exp_avg_sq"])
            assert torch.equal(p.detach().to(torch.bfloat16).to("cuda"), slot.weight)


def test_model_split_on_cuda_keeps_state_pinned_and_finite():
    _, _, slots = _setup("cpu")
    lines = []
    device = torch.device("cuda", torch.cuda.current_device())
    offload = InterleavedOffload(CudaLanes(device), 1 << 18, log=lines.append)
    for step in range(3):
        _grads(slots, None, step)
        offload.step(slots)
    assert all(slot.master.is_pinned() and slot.state["exp_avg"].is_pinned() for slot in slots)
    assert all(torch.isfinite(slot.master).all() and torch.isfinite(slot.weight.float()).all() for slot in slots)
    assert len(lines) == 3
