"""Let megatron-core's ``dist_checkpointing`` run in a process without a GPU.

``megatron-ext convert`` reads and writes ``torch_dist`` checkpoints with megatron-core's own code,
typically on a login or CPU node. That code names the CUDA device even when it only moves bytes:
it creates small tensors with ``device=torch.cuda.current_device()`` for its collectives and calls
``torch.cuda.synchronize()`` around its writes. ``enable_cpu_device()`` answers those calls with
the CPU. Where CUDA is available it does nothing.

Training on CPU ranks needs more (RNG trackers, optimizer type checks, reduce-scatter over gloo);
that lives with the test code in ``megatron_ext.testing.cpu_emulation``, which builds on this.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpuMode", "enable_cpu_device", "is_cuda_device"]

_lock = threading.Lock()
_active: list[TorchFunctionMode] = []  # the modes pushed so far in this process


def is_cuda_device(device: Any) -> bool:
    """True for every spelling of a CUDA device megatron uses: 'cuda', 'cuda:0', an int index."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU on every torch call made while the mode is active.

    A function mode sees factory functions (``torch.empty(..., device='cuda')``) and tensor
    methods (``t.cuda()``, ``t.to('cuda')``) alike, so no megatron module needs to be patched for
    device placement. Subclasses answer more (see ``answer``).
    """

    def answer(self, func, args, kwargs) -> Any:
        """A result for ``func`` without calling it, or ``NotImplemented`` to run it on the CPU."""
        return NotImplemented

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}  # the callee's own: ``answer`` may change it
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"

        if func is torch.Tensor.cuda:
            return args[0]
        answered = self.answer(func, args, kwargs)
        if answered is not NotImplemented:
            return answered
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _patch_torch_cuda_device() -> None:
    """Send the CUDA device and synchronisation helpers to their CPU equivalents."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None


def enable_cpu_device(mode: CudaToCpuMode | None = None) -> bool:
    """Answer megatron-core's CUDA device calls with the CPU; returns True when this is active.

    Idempotent, and does nothing (returns False) when CUDA is available, so calling it
    unconditionally is safe on GPU machines. ``mode`` (default ``CudaToCpuMode()``) is pushed for
    the rest of the process; a later call with a mode of another class pushes that one on top.
    """
    if torch.cuda.is_available():
        return False
    mode = mode if mode is not None else CudaToCpuMode()
    with _lock:
        if any(type(active) is type(mode) for active in _active):
            return True
        _patch_torch_cuda_device()
        mode.__enter__()
        _active.append(mode)
        return True
