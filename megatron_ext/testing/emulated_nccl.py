"""A default process group that refuses host tensors as NCCL does, for CPU runs of GPU code.

On a GPU node Megatron-LM creates its default process group with ``--distributed-backend nccl``,
which has no CPU path: a collective on a tensor in host memory fails with ``No backend type
associated with device type cpu``. The CPU test runs use gloo, which takes any tensor, so code that
all-reduces ``torch.tensor([0])`` passes every CPU test and crashes every GPU job. This module
makes the CPU runs refuse what NCCL refuses:

* ``HostTensorMode`` (a torch function mode) marks the tensors that would live in host memory on a
  GPU node: those made by a factory without a device or with ``device='cpu'``, by ``.cpu()``,
  ``.to('cpu')``, ``from_numpy``, and every result computed only from such tensors. A device given
  as a ``torch.device`` object (typically another tensor's ``.device``, which here says ``cpu`` for
  every tensor) marks nothing: the emulation errs towards letting a call through. Moving a
  marked tensor to ``cuda`` gives an unmarked copy, as ``.cuda()`` copies on a GPU node. It sits
  above the CPU emulation's device mode, so it sees the device a call asked for before that mode
  answers it with the CPU.
* ``EmulatedNccl`` is a process group (torch's Python process group API) that checks every tensor
  of every collective and point-to-point call and refuses a marked one with NCCL's own message,
  then hands the call to a gloo group over the same store. It is registered for the ``cuda``
  device only, so torch's object collectives (``all_gather_object``, ...) build their tensors on
  ``cuda`` for it, as they do for NCCL.
* ``enable_emulated_nccl()`` registers it and routes ``backend='nccl'`` (``init_process_group``,
  ``new_group``) to it; ``get_backend`` answers ``nccl`` for its groups, as Megatron-LM's code asks.

Gloo groups made explicitly (``backend='gloo'``) stay gloo and take host tensors, as on a GPU node.
Test and demo code only; nothing of it runs where CUDA is available.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_ext.megatron.cpu_device import is_cuda_device

__all__ = ["BACKEND", "EmulatedNccl", "HostTensorMode", "enable_emulated_nccl", "is_host_tensor", "mark_host"]

BACKEND = "emulated_nccl"
NCCL_REFUSAL = "No backend type associated with device type cpu"
_MARK = "_megatron_ext_host_tensor"

# Factories whose result lives on the default device (the host) unless a device is given.
_FACTORIES = frozenset(f for f in (
    torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
    torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
    torch.empty_strided, torch.scalar_tensor, torch.from_numpy, torch.frombuffer, torch.tril_indices,
    torch.triu_indices) if f is not None)


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as one that lives in host memory on a GPU node."""
    setattr(tensor, _MARK, True)
    return tensor


def is_host_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and getattr(tensor, _MARK, False)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _requested_device(func: Callable, args: tuple, kwargs: dict) -> str | None:
    """The device a call asks for: 'host', 'cuda', 'unknown', or None when it names none.

    Only spellings that mean the host on a GPU node count as 'host': the string ``'cpu'``,
    ``.cpu()``, ``.pin_memory()``. A ``torch.device`` object is 'unknown': here a tensor's
    ``.device`` answers ``cpu`` even for the emulation's CUDA tensors, so code passing
    ``device=other.device`` must not be taken for a host request.
    """
    device = kwargs.get("device")
    if func is torch.Tensor.to:
        device = device if device is not None else next(
            (a for a in args[1:] if isinstance(a, (str, int, torch.device)) and not isinstance(a, bool)), None)
        if device is None:
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), None)
            if other is not None:
                return "host" if is_host_tensor(other) else "cuda"
    elif func is torch.Tensor.cuda:
        return "cuda"
    elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
        return "host"
    if device is None:
        return None
    if is_cuda_device(device):
        return "cuda"
    return "host" if isinstance(device, str) else "unknown"


# The calls whose device ``_requested_device`` reads from the function itself, not only from ``device=``.
_DEVICE_FUNCS = frozenset((torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory))


def _host_inputs(values: Any) -> tuple[bool, bool]:
    """(any tensor among ``values``, all of them host tensors), ``_tensors``' walk stopping at the
    first tensor that is not a host one: most calls of a training step take device tensors, and
    this runs on every torch call."""
    seen = False
    for value in values:
        if isinstance(value, torch.Tensor):
            if not getattr(value, _MARK, False):
                return True, False
            seen = True
        elif isinstance(value, (list, tuple)):
            found, host = _host_inputs(value)
            if found and not host:
                return True, False
            seen = seen or found
    return seen, seen


class HostTensorMode(TorchFunctionMode):
    """Marks the tensors that would be in host memory on a GPU node (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wanted = _requested_device(func, args, kwargs) if func in _DEVICE_FUNCS or "device" in kwargs else None
        if wanted == "cuda":
            inputs = _tensors(args) + _tensors(list(kwargs.values()))
            result = func(*args, **kwargs)
            # On a GPU node moving a host tensor to the GPU makes a new tensor; here the device
            # mode below hands back the same one, so give the copy that NCCL would see.
            if any(result is t and is_host_tensor(t) for t in inputs):
                result = result.clone()  # dispatched to the modes below this one
            return result
        if wanted == "host":
            mark = True
        else:
            found, host = _host_inputs((*args, *kwargs.values()))
            mark = (not found) if func in _FACTORIES else host
            mark = mark and (wanted is None or func not in _FACTORIES)
        result = func(*args, **kwargs)
        if mark:
            for tensor in _tensors(result):
                mark_host(tensor)
        return result


def _refuse_host_tensors(name: str) -> Callable:
    def call(self: "EmulatedNccl", *args: Any, **kwargs: Any) -> Any:
        for tensor in _tensors([*args, *kwargs.values()]):
            if is_host_tensor(tensor):
                raise RuntimeError(f"{NCCL_REFUSAL} ({name} on a tensor that lives in host memory on a GPU node: "
                                   f"{tuple(tensor.shape)} {tensor.dtype})")
        return getattr(self.gloo, name)(*args, **kwargs)

    call.__name__ = name
    return call


class EmulatedNccl(dist.ProcessGroup):
    """A process group that refuses host tensors like NCCL and runs everything else on gloo."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any):
        super().__init__(rank, size)
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        # A plain gloo process group over the same connections runs the calls this one lets through.
        self.gloo = dist.ProcessGroup(store, rank, size)
        self.gloo._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.gloo._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        # Registered for cuda only, as NCCL: object collectives then stage their bytes on "cuda".
        self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, backend)

    for _name in ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                  "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
                  "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                  "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
                  "all_to_all_single", "gather", "scatter", "send", "recv", "recv_anysource"):
        locals()[_name] = _refuse_host_tensors(_name)
    del _name

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self.gloo.barrier(*args, **kwargs)

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self.gloo.monitored_barrier(*args, **kwargs)

    def _start_coalescing(self, device: Any) -> Any:
        return self.gloo._start_coalescing(torch.device("cpu"))

    def _end_coalescing(self, device: Any) -> Any:
        return self.gloo._end_coalescing(torch.device("cpu"))


_lock = threading.Lock()
_enabled = False


def _nccl_to_emulated(backend: Any) -> Any:
    return BACKEND if isinstance(backend, str) and backend.lower() == "nccl" else backend


def enable_emulated_nccl() -> bool:
    """Make ``backend='nccl'`` mean ``EmulatedNccl`` and mark host tensors; True when active.

    A no-op (False) where CUDA is available. Call it before the process group is created and
    after the CPU emulation's device mode is pushed (this mode must sit above it).
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    with _lock:
        if _enabled:
            return True
        dist.Backend.register_backend(BACKEND, EmulatedNccl, devices=["cuda"])
        c10d = dist.distributed_c10d
        init, new_group, get_backend = c10d.init_process_group, c10d.new_group, c10d.get_backend

        @functools.wraps(init)
        def init_process_group(backend: Any = None, *args: Any, **kwargs: Any):
            return init(_nccl_to_emulated(backend), *args, **kwargs)

        @functools.wraps(new_group)
        def new_group_(*args: Any, **kwargs: Any):
            if "backend" in kwargs:
                kwargs["backend"] = _nccl_to_emulated(kwargs["backend"])
            elif len(args) >= 3:
                args = (*args[:2], _nccl_to_emulated(args[2]), *args[3:])
            return new_group(*args, **kwargs)

        @functools.wraps(get_backend)
        def get_backend_(group: Any = None) -> Any:
            name = get_backend(group)
            return "nccl" if name == BACKEND else name

        for module in (dist, c10d):
            module.init_process_group, module.new_group, module.get_backend = init_process_group, new_group_, get_backend_
        # torch's collective logger asks NCCL's version when a collective on an "nccl" group fails.
        torch.cuda.nccl.version = lambda: (0, 0, 0)
        HostTensorMode().__enter__()
        _enabled = True
        return True
