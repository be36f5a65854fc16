"""The CPU emulation's bf16/fp16 products in fp32 (``megatron_ext/testing/low_precision_matmul.py``).

These tests run the mode on every machine, whether or not it is ``NEEDED`` there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.testing import low_precision_matmul
from megatron_ext.testing.low_precision_matmul import Fp32MatmulMode


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
    with Fp32MatmulMode():
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
    with Fp32MatmulMode():
        _PythonLinear.apply(x, w).backward(grad)
    xf, wf = _fp32_twin(x, w)
    _PythonLinear.apply(xf, wf).backward(grad.float())
    assert torch.equal(x.grad, xf.grad.bfloat16())
    assert torch.equal(w.grad, wf.grad.bfloat16())


def test_batched_and_accumulating_products_and_out():
    torch.manual_seed(2)
    a = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    b = torch.randn(3, 7, 4, dtype=torch.bfloat16)
    c = torch.randn(3, 5, 4, dtype=torch.bfloat16)
    out = torch.empty(3, 5, 4, dtype=torch.bfloat16)
    with Fp32MatmulMode():
        bmm = torch.bmm(a, b)
        baddbmm = torch.baddbmm(c, a, b, beta=0.5, alpha=2.0)
        returned = torch.bmm(a, b, out=out)
    assert torch.equal(bmm, torch.bmm(a.float(), b.float()).bfloat16())
    assert torch.equal(baddbmm, torch.baddbmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0).bfloat16())
    assert returned is out and torch.equal(out, bmm)


class _Calls(TorchDispatchMode):
    """Records the products that reach torch's kernels, with their operands' dtypes."""

    def __init__(self):
        super().__init__()
        self.products = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.products.append((func.overloadpacket.__name__, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def test_the_kernels_get_fp32_operands():
    """The values alone cannot tell (torch's scalar loop also sums in fp32): what the kernels receive can."""
    a = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    with _Calls() as calls, Fp32MatmulMode():
        F.linear(a, w).sum().backward()
    assert [name for name, _ in calls.products] == ["mm", "mm", "mm"]  # forward, then both gradients
    assert all(dtypes == [torch.float32, torch.float32] for _, dtypes in calls.products)


def test_other_ops_and_fp32_products_are_untouched():
    torch.manual_seed(3)
    a, b = torch.randn(6, 6), torch.randn(6, 6)
    h = torch.randn(6, 6, dtype=torch.bfloat16)
    with Fp32MatmulMode():
        fp32 = a @ b
        softmax = torch.softmax(h, dim=-1)
    assert torch.equal(fp32, a @ b)
    assert softmax.dtype == torch.bfloat16 and torch.equal(softmax, torch.softmax(h, dim=-1))


def test_mixed_dtypes_are_refused_as_without_the_mode():
    a = torch.randn(4, 4, dtype=torch.bfloat16)
    b = torch.randn(4, 4)
    with pytest.raises(RuntimeError) as without:
        torch.mm(a, b)
    with Fp32MatmulMode(), pytest.raises(RuntimeError) as with_mode:
        torch.mm(a, b)
    assert type(with_mode.value) is type(without.value)


def test_the_mode_is_wanted_exactly_where_torch_has_no_native_bf16_gemm():
    assert low_precision_matmul.NEEDED is (not low_precision_matmul.native_low_precision_gemm())
    assert low_precision_matmul.enable() is low_precision_matmul.NEEDED
