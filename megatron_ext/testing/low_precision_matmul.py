"""bf16/fp16 matrix products in fp32 on CPUs without a native low-precision GEMM (test harness only).

On an x86 CPU with AVX-512, torch's bf16 and fp16 GEMMs go to oneDNN. On an AVX2-only CPU they
fall back to a scalar loop that is 5-70 times slower than fp32 (AMD EPYC, torch 2.13: a
512x2048x512 bf16 product 190 ms against 37 ms in fp32, one thread). A bf16 megatron-core model on
CPU ranks then spends nearly all its time there: the reference trainer's bench model took 55 s an
iteration instead of 0.6 s, and the test suite outgrew its time.

``Fp32MatmulMode`` computes those products in fp32 and rounds the result to the tensors' dtype
once, as oneDNN and a GPU's tensor cores do (fp32 accumulation, one rounding); only the order of the
sums differs from the scalar loop. It is deterministic, so two runs on one machine stay
bit-identical, which is what every comparison in the tests needs (none compares values across
machines). It is a dispatch mode, below autograd: forward and backward products alike (megatron's
linear layers compute their gradients in a Python ``backward``, which no function mode sees), and
the autograd graph is the one torch builds for bf16.

``enable()`` pushes it for the rest of the process on the calling thread (the training thread), and
only where ``NEEDED``: on a CPU with a native GEMM nothing changes.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NEEDED", "Fp32MatmulMode", "enable", "native_low_precision_gemm"]

_LOW = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
# The products autograd and the composite ops (linear, matmul, einsum) come down to.
_PRODUCTS = frozenset({_aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.mv, _aten.addmv})


def native_low_precision_gemm() -> bool:
    """True where torch's bf16 GEMM runs natively (oneDNN's check: AVX-512 or AMX; any CPU but x86)."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if check is None or not torch.backends.mkldnn.is_available():
        return True  # not an x86 build with oneDNN: nothing known to replace
    return bool(check())


NEEDED = not native_low_precision_gemm()


class Fp32MatmulMode(TorchDispatchMode):
    """Products of bf16 or fp16 tensors computed in fp32 and rounded once; every other op untouched.

    Only calls whose tensors all share one low-precision dtype are taken: a mixed call is left to
    torch, which refuses it as a GPU would. An ``out=`` overload gets the rounded result.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _PRODUCTS:
            dtype = _common_low_dtype(args, kwargs)
            if dtype is not None:
                kwargs = dict(kwargs)
                out = kwargs.pop("out", None)
                result = packet.default(*map(_in_fp32, args), **{k: _in_fp32(v) for k, v in kwargs.items()}).to(dtype)
                if out is None:
                    return result
                return out.copy_(result)
        return func(*args, **kwargs)


def _common_low_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The one bf16/fp16 dtype every tensor argument (``out`` aside) has, else None."""
    dtype = None
    for a in (*args, *(v for k, v in kwargs.items() if k != "out")):
        if isinstance(a, torch.Tensor):
            if a.dtype not in _LOW or (dtype is not None and a.dtype != dtype):
                return None
            dtype = a.dtype
    return dtype


def _in_fp32(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) else value


_lock = threading.Lock()
_pushed = False


def enable() -> bool:
    """Push ``Fp32MatmulMode`` for the rest of the process where ``NEEDED``; True when it is active.

    Idempotent. Dispatch modes are per thread: call it on the thread that trains.
    """
    global _pushed
    if not NEEDED:
        return False
    with _lock:
        if not _pushed:
            Fp32MatmulMode().__enter__()
            _pushed = True
    return True
