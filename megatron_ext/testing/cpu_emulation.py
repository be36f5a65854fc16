"""Run real megatron-core on CPU ranks (gloo) by answering its few CUDA assumptions.

megatron-core (0.19.0) trains on a CPU almost unchanged; what stops it is a handful of places where
it names the CUDA device or calls a CUDA-only API:

* tensors are created with ``device='cuda'`` / ``device=torch.cuda.current_device()`` and moved
  with ``.cuda()``;
* the mixed-precision optimizer checks ``param.type()`` against ``'torch.cuda.BFloat16Tensor'``
  and friends to decide which parameters get fp32 main copies;
* the RNG tracker (``tensor_parallel.random``) saves and restores the CUDA generator;
* DDP and the gradient buffers record and wait on CUDA streams and events;
* the distributed optimizer reduce-scatters gradients, which gloo does not implement;
* the hybrid device optimizer (``--optimizer-cpu-offload``) pins its host copies and tells device
  parameters from host ones with ``is_cuda`` (``as_device_tensors``).

``enable_cpu_emulation()`` answers each of these for CPU tensors; the device placement part is the
product's ``megatron_ext.megatron.cpu_device`` (what ``megatron-ext convert`` needs on a CPU node),
the rest is here. It is meant for tests and the CPU demo: when a GPU is present it does nothing, so
the production path never sees it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.megatron.cpu_device import CudaToCpuMode, enable_cpu_device
from megatron_ext.testing import low_precision_matmul

__all__ = ["as_device_tensors", "enable_cpu_emulation", "is_cpu_emulation_enabled"]

_lock = threading.Lock()
_enabled = False
_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]  # the getter a function mode sees for ``t.is_cuda``
# The CPU tensors that stand for device tensors now, by id (held, so no other tensor takes an id).
_device_tensors: dict[int, torch.Tensor] = {}
_STAYS_ON_DEVICE = (torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.float)  # of a device tensor: one too

# What ``Tensor.type()`` answers for CPU tensors: the names megatron's optimizer compares against.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class _CudaTrainingMode(CudaToCpuMode):
    """The CPU device mode, plus ``Tensor.type()`` answering the CUDA names the optimizer expects.

    Pinned host memory needs an accelerator: on a CPU-only process ``pin_memory()`` is the tensor
    itself and ``pin_memory=True`` allocates plain memory. ``is_cuda`` is true for the tensors
    ``as_device_tensors`` names while it is active.
    """

    def answer(self, func, args, kwargs):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if _device_tensors and args and isinstance(args[0], torch.Tensor):
            if getattr(func, "__self__", None) is _IS_CUDA:
                return id(args[0]) in _device_tensors or func(*args)
            if id(args[0]) in _device_tensors:
                if func is torch.Tensor.cpu:  # a host tensor: not the device's any more
                    return args[0].detach()
                if func in _STAYS_ON_DEVICE:
                    out = func(*args, **kwargs)
                    _device_tensors[id(out)] = out
                    return out
        if func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # the caller's dict: the call then runs with plain memory
        return NotImplemented


@contextlib.contextmanager
def as_device_tensors(tensors):
    """Within the block ``t.is_cuda`` is true for these CPU tensors (the emulated device's).

    megatron-core's hybrid device optimizer (``--optimizer-cpu-offload``) decides which parameters
    live on the device, and which it offloads to host copies, by ``is_cuda``; on CPU ranks the
    model's parameters stand for the device's. As on a GPU, a ``detach``, ``clone`` or ``float``
    of a device tensor made in the block is a device tensor too, and ``cpu()`` makes a host one.
    Not reentrant; every tensor marked in the block is unmarked at its end.
    """
    with _lock:
        _device_tensors.update((id(t), t) for t in tensors)
    try:
        yield
    finally:
        with _lock:
            _device_tensors.clear()


def _reduce_scatter_via_all_reduce(output, input, op=dist.ReduceOp.SUM, group=None,
                                   async_op=False):
    """gloo has no reduce-scatter: all-reduce a copy of the input and keep this rank's slice.

    Costs a full all-reduce instead of a reduce-scatter, which is irrelevant at test sizes.
    The work is done synchronously; when ``async_op`` is requested a completed handle is returned.
    """
    reduced = input.clone()
    dist.all_reduce(reduced, op=op, group=group)
    rank = dist.get_rank(group)
    numel = output.numel()
    output.copy_(reduced.view(-1)[rank * numel:(rank + 1) * numel].view_as(output))
    return _CompletedWork() if async_op else None


class _CompletedWork:
    """Stands in for a ``dist.Work`` handle of an operation that already finished."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _patch_torch_cuda_rng() -> None:
    """Send the CUDA seed and RNG-state helpers megatron calls to their CPU equivalents."""
    cuda = torch.cuda
    # Seed only the CPU generator: ``torch.manual_seed`` itself calls ``cuda.manual_seed_all``.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


def _patch_megatron() -> None:
    """Point megatron's own CUDA helpers and import-time bound collectives at the CPU versions.

    ``_get_cuda_rng_state``/``_set_cuda_rng_state`` reach ``torch.cuda.default_generators``
    directly, and several modules bind ``reduce_scatter_tensor`` to a module global at import
    time, so patching ``torch`` alone is not enough.
    """
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )

    # On a CPU the "CUDA" generator *is* the CPU generator, so the tracker's check that forked
    # regions leave the CPU RNG alone fires on every dropout; it is expected here, not a bug.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)

    import importlib

    for name in ("megatron.core.distributed.param_and_grad_buffer",
                 "megatron.core.tensor_parallel.mappings",
                 "megatron.core.tensor_parallel.layers"):
        module = importlib.import_module(name)
        if hasattr(module, "dist_reduce_scatter_func"):
            module.dist_reduce_scatter_func = _reduce_scatter_via_all_reduce


class CpuEvent:
    """Stands in for ``torch.cuda.Event``: on a CPU the work it marks is already done."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuStream:
    """Stands in for ``torch.cuda.Stream``: on a CPU every operation is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = CpuStream()


def _patch_cuda_streams() -> None:
    """CUDA streams and events answer on a CPU: megatron-core records and waits on them (DDP's side
    stream, ``start_grad_sync``'s current stream, the MoE dispatcher's events)."""
    cuda = torch.cuda
    cuda.Stream = CpuStream
    cuda.Event = CpuEvent
    cuda.current_stream = lambda device=None: _STREAM
    cuda.default_stream = lambda device=None: _STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()


def enable_cpu_emulation() -> bool:
    """Make megatron-core train on CPU ranks; returns True when the emulation is active.

    Idempotent. Does nothing (and returns False) when CUDA is available, so calling it
    unconditionally is safe on GPU machines. Call it before building models or optimizers; the
    device mode stays pushed for the rest of the process.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    with _lock:
        if _enabled:
            return True
        enable_cpu_device(_CudaTrainingMode())  # torch.cuda's device helpers and the device mode
        _patch_torch_cuda_rng()
        _patch_cuda_streams()
        dist.reduce_scatter_tensor = _reduce_scatter_via_all_reduce
        dist._reduce_scatter_base = _reduce_scatter_via_all_reduce
        _patch_megatron()
        low_precision_matmul.enable()  # an AVX2-only CPU: bf16 products in fp32, else nothing
        _enabled = True
        return True


def is_cpu_emulation_enabled() -> bool:
    """True once ``enable_cpu_emulation()`` has switched the emulation on in this process."""
    return _enabled
