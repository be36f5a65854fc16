"""The CPU emulation's bf16/fp16 products in fp32 (``megatron_ext/testing/low_precision_matmul.py``).

These tests register the kernels on every machine, whether or not they are ``NEEDED`` there, and
remove them after (a registration is process-wide: the rest of the session must not inherit it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.testing import low_precision_matmul
from megatron_ext.testing.low_precision_matmul import Fp32Products

from helpers.procs import child_env


def _fp32_twin(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """fp32 copies of the tensors, leaves of their own graph: the same computation without the mode."""
    return [t.detach().float().requires_grad_(t.requires_grad) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_forward_and_backward_are_fp32_products_rounded_once(dtype):
    torch.manual_seed(0)
    x = torch.randn(16, 32).to(dtype).requires_grad_()
    w = torch.randn(24, 32).to(dtype).requires_grad_()
    b = torch.randn(24).to(dtype).requires_grad_()
    grad = torch.randn(16, 24).to(dtype)
    with Fp32Products():
        y = F.linear(x, w, b)
        y.backward(grad)
    xf, wf, bf = _fp32_twin(x, w, b)
    yf = F.linear(xf, wf, bf)
    yf.backward(grad.float())
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    assert torch.equal(y, yf.to(dtype))
    assert torch.equal(x.grad, xf.grad.to(dtype))
    assert torch.equal(w.grad, wf.grad.to(dtype))


class _PythonLinear(torch.autograd.Function):
    """As megatron's linear layers: the products of the backward are called from Python."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.matmul(w), g.t().matmul(x)


def test_a_custom_backward_is_seen_too():
    torch.manual_seed(1)
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8, 4, dtype=torch.bfloat16)
    with Fp32Products():
        _PythonLinear.apply(x, w).backward(grad)
    xf, wf = _fp32_twin(x, w)
    _PythonLinear.apply(xf, wf).backward(grad.float())
    assert torch.equal(x.grad, xf.grad.bfloat16())
    assert torch.equal(w.grad, wf.grad.bfloat16())


def test_batched_and_accumulating_products_and_torchs_own_out():
    torch.manual_seed(2)
    a = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    b = torch.randn(3, 7, 4, dtype=torch.bfloat16)
    c = torch.randn(3, 5, 4, dtype=torch.bfloat16)
    out = torch.empty(3, 5, 4, dtype=torch.bfloat16)
    with Fp32Products():
        bmm = torch.bmm(a, b)
        baddbmm = torch.baddbmm(c, a, b, beta=0.5, alpha=2.0)
        returned = torch.bmm(a, b, out=out)
    assert torch.equal(bmm, torch.bmm(a.float(), b.float()).bfloat16())
    assert torch.equal(baddbmm, torch.baddbmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0).bfloat16())
    # the out= forms stay torch's (the loops never call them): the same bytes as outside
    assert returned is out and torch.equal(out, torch.bmm(a, b, out=torch.empty_like(out)))


def _products(profile) -> list[tuple[str, list[str]]]:
    """The products torch's profiler saw, in order, with their operands' dtypes (an ``out=`` last)."""
    return [(e.name, list(e.input_dtypes)) for e in profile.events() if e.name in ("aten::mm", "aten::addmm")]


def test_the_kernels_get_fp32_operands():
    """The values alone cannot tell (torch's scalar loop also sums in fp32): what the kernels receive can."""
    a = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    with Fp32Products(), torch.profiler.profile(record_shapes=True) as profile:
        F.linear(a, w).sum().backward()
    products = _products(profile)
    bf16, fp32 = ["c10::BFloat16"] * 2, ["float", "float", "float"]
    # forward, then both gradients: each bf16 call runs the kernel's out= form on fp32 operands
    assert products == [("aten::mm", bf16), ("aten::mm", fp32)] * 3, products


def test_products_are_torchs_own_once_the_kernels_are_removed():
    a = torch.randn(4, 8, dtype=torch.bfloat16)
    with Fp32Products():
        pass
    with torch.profiler.profile(record_shapes=True) as profile:
        torch.mm(a, a.t())
    assert _products(profile) == [("aten::mm", ["c10::BFloat16"] * 2)]


def test_other_ops_and_fp32_products_are_untouched():
    torch.manual_seed(3)
    a, b = torch.randn(6, 6), torch.randn(6, 6)
    h = torch.randn(6, 6, dtype=torch.bfloat16)
    with Fp32Products():
        fp32 = a @ b
        softmax = torch.softmax(h, dim=-1)
    assert torch.equal(fp32, a @ b)
    assert softmax.dtype == torch.bfloat16 and torch.equal(softmax, torch.softmax(h, dim=-1))


def test_mixed_dtypes_are_refused_as_without_the_mode():
    a = torch.randn(4, 4, dtype=torch.bfloat16)
    b = torch.randn(4, 4)
    with pytest.raises(RuntimeError) as without:
        torch.mm(a, b)
    with Fp32Products(), pytest.raises(RuntimeError) as with_mode:
        torch.mm(a, b)
    assert type(with_mode.value) is type(without.value)


def test_the_kernels_are_wanted_exactly_where_torch_has_no_native_bf16_gemm():
    """``enable()`` lasts for the process: asked in a child, so this session keeps torch's kernels."""
    code = ("import torch; from megatron_ext.testing import low_precision_matmul as m\n"
            "a = torch.randn(4, 8, dtype=torch.bfloat16)\n"
            "active = m.enable()\n"
            "with torch.profiler.profile(record_shapes=True) as p:\n"
            "    torch.mm(a, a.t())\n"
            "fp32 = any(e.name == 'aten::mm' and 'float' in e.input_dtypes for e in p.events())\n"
            "print(active, m.NEEDED, m.native_low_precision_gemm(), fp32)")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    active, needed, native, fp32 = proc.stdout.split()[-4:]
    assert needed == str(not low_precision_matmul.native_low_precision_gemm()) == str(native != "True")
    assert active == needed == fp32
