"""bf16/fp16 matrix products in fp32 on CPUs without a native low-precision GEMM (test harness only).

On an x86 CPU with AVX-512, torch's bf16 and fp16 GEMMs go to oneDNN. On an AVX2-only CPU they
fall back to a scalar loop that is 5-70 times slower than fp32 (AMD EPYC, torch 2.13: a
512x2048x512 bf16 product 190 ms against 37 ms in fp32, one thread). A bf16 megatron-core model on
CPU ranks then spends nearly all its time there: the reference trainer's bench model took 55 s an
iteration instead of 0.6 s, and the test suite outgrew its time.

``Fp32Products`` computes those products in fp32 and rounds the result to the tensors' dtype once,
as oneDNN and a GPU's tensor cores do (fp32 accumulation, one rounding); only the order of the sums
differs from the scalar loop. It is deterministic, so two runs on one machine stay bit-identical,
which is what every comparison in the tests needs (none compares values across machines).

It replaces the CPU kernels of the products themselves (``torch.library``), below autograd: forward
and backward products alike (megatron's linear layers compute their gradients in a Python
``backward``), with the autograd graph torch builds for bf16. Every other op keeps its C++ path: a
dispatch mode, as before, sent each of them through Python, and its garbage (a quarter of a rank's
time went to the collector) cost more than the products it saved. Each product calls the same
kernel's ``out=`` form, which keeps its own kernel: for fp32, float64, integer and mixed-dtype
calls (refused as without the emulation) that is the call torch would have made. The products'
``out=`` forms themselves stay torch's: the training loops never call them.

``enable()`` registers the kernels for the rest of the process, in every thread, and only where
``NEEDED``: on a CPU with a native GEMM nothing changes.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["NEEDED", "PRODUCTS", "Fp32Products", "enable", "native_low_precision_gemm"]

_LOW = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
# The products autograd and the composite ops (linear, matmul, einsum) come down to.
PRODUCTS = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv")


def native_low_precision_gemm() -> bool:
    """True where torch's bf16 GEMM runs natively (oneDNN's check: AVX-512 or AMX; any CPU but x86)."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if check is None or not torch.backends.mkldnn.is_available():
        return True  # not an x86 build with oneDNN: nothing known to replace
    return bool(check())


NEEDED = not native_low_precision_gemm()


def _low_dtype(*tensors: torch.Tensor) -> torch.dtype | None:
    """The one bf16/fp16 dtype every operand has, else None."""
    dtype = tensors[0].dtype
    return dtype if dtype in _LOW and all(t.dtype == dtype for t in tensors[1:]) else None


def _kernel(name: str):
    """The CPU kernel of product ``name``: its ``out=`` form, on fp32 copies when the operands are low precision."""
    out_form = getattr(_aten, name).out

    def product(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        dtype = _low_dtype(*tensors)
        if dtype is None:
            return out_form(*args, **kwargs, out=tensors[-1].new_empty((0,)))
        fp32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        return out_form(*fp32, **kwargs, out=tensors[-1].new_empty((0,), dtype=torch.float32)).to(dtype)

    product.__name__ = f"fp32_{name}"
    return product


class Fp32Products:
    """While entered, the CPU products of bf16 or fp16 tensors are computed in fp32 and rounded once.

    Process-wide (a kernel registration), not per thread. Only calls whose tensors all share one
    low-precision dtype are taken: a mixed call is refused by the kernel, as a GPU refuses it.
    """

    def __enter__(self) -> Fp32Products:
        self._library = torch.library.Library("aten", "IMPL")
        for name in PRODUCTS:
            self._library.impl(name, _kernel(name), "CPU")
        return self

    def __exit__(self, *exc: object) -> None:
        self._library._destroy()


_lock = threading.Lock()
_registered: Fp32Products | None = None


def enable() -> bool:
    """Register ``Fp32Products`` for the rest of the process where ``NEEDED``; True when it is active. Idempotent."""
    global _registered
    if not NEEDED:
        return False
    with _lock:
        if _registered is None:
            _registered = Fp32Products().__enter__()
    return True
