"""``--datastates-interleaved-offload``: megatron-core's hybrid device optimizer, stepped interleaved.

``InterleavedOffloadOptimizer`` subclasses ``HybridDeviceOptimizer`` (HDO) at offload fraction
1.0: every fp32 master and Adam moment stays where HDO keeps offloaded state, in its CPU
sub-optimizers (masters pinned on a GPU node), so the distributed optimizer's state dicts, its
checkpointing, and this project's save/load see exactly HDO's layout: checkpoints taken with and
without the flag are interchangeable. Only ``step`` differs: instead of HDO's per-tensor CPU
steps, ``megatron_ext.offload`` updates some subgroups of that state on the GPU (staged in and
written back on side streams) and the rest on the CPU, the split chosen each step by its
performance model. Megatron-LM clips the gradients before it calls the inner ``step``, so
nothing is updated before the norm is known.

``install`` (from ``validate_datastates_args``) makes megatron-core build this class wherever it
builds HDO: ``get_megatron_optimizer`` and the distributed optimizer's rebuild both look the
name up in their modules at call time.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from megatron_ext.offload.interleaved import StateSlot, InterleavedOffload
from megatron_ext.offload.lanes import lanes_for

log = logging.getLogger(__name__)

DEFAULT_SUBGROUP_NUMEL = 1 << 24  # 16M elements: 192 MiB of fp32 master and moments per staging buffer


class InterleavedOffloadOptimizer(HybridDeviceOptimizer):
    """HDO at fraction 1.0 whose step runs the interleaved update over its CPU sub-optimizers' state."""

    subgroup_numel = DEFAULT_SUBGROUP_NUMEL

    def __init__(self, params, offload_fraction=1.0, **kwargs):
        self._offload: InterleavedOffload | None = None
        super().__init__(params, offload_fraction=1.0, **kwargs)

    def _host_params(self):
        """``(CPU sub-optimizer, param group, fp32 host param)`` for every tensor HDO offloaded."""
        for optimizer in self.cpu_optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    yield optimizer, group, param

    def _init_sub_optimizers(self):
        super()._init_sub_optimizers()
        if torch.cuda.is_available():  # HDO's fp32 copies of bf16 weights are pageable: pin them
            for _, _, param in self._host_params():
                if not param.is_pinned():
                    param.data = param.data.pin_memory()

    def _interleaved(self) -> InterleavedOffload:
        if self._offload is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))
            self._offload = InterleavedOffload(lanes_for(device), self.subgroup_numel, policy="model", log=log.info)
        return self._offload

    def _slots(self) -> list[StateSlot]:
        """One slot per host param with a gradient this step: HDO's master and state, the device grad and weight."""
        slots = []
        for optimizer, group, param in self._host_params():
            device_param = self.cpu_copys_map_gpu_param[param]
            grad = getattr(device_param, "decoupled_grad", device_param.grad)
            if grad is None:
                continue
            state = optimizer.state[param]
            if torch.cuda.is_available():  # a loaded state comes pageable (HDO moves it with .to("cpu"))
                _pin_state(state)
            slots.append(StateSlot(param.data, grad, state, group, device_param.data))
        return slots

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("the interleaved offload optimizer takes no closure")
        if self.gpu_optimizer is not None:
            raise RuntimeError("the interleaved offload optimizer keeps every parameter's state on the host")
        self._sync_hdo_param_groups_to_sub_optimizers()
        self._interleaved().step(self._slots())
        self._sync_sub_optimizers_state_to_hdo()


def _pin_state(state: dict) -> None:
    """Pin ``state``'s pageable tensors in place (the step count excepted): the side lanes copy them asynchronously."""
    for key, value in state.items():
        if key != "step" and isinstance(value, torch.Tensor) and not value.is_pinned():
            state[key] = value.pin_memory()


def _refusals(args: Any) -> list[str]:
    problems = []
    if not getattr(args, "optimizer_cpu_offload", False):
        problems.append("--datastates-interleaved-offload steps megatron-core's offloaded optimizer: it needs "
                        "--optimizer-cpu-offload")
    fraction = getattr(args, "optimizer_offload_fraction", 1.0)
    if fraction != 1.0:
        problems.append(f"--datastates-interleaved-offload keeps all optimizer state on the host and splits the "
                        f"update each step itself: drop --optimizer-offload-fraction {fraction} (or give 1.0)")
    size = getattr(args, "datastates_offload_subgroup_numel", None)
    if size is not None and size <= 0:
        problems.append(f"--datastates-offload-subgroup-numel must be positive, not {size}")
    if getattr(args, "optimizer", "adam") not in ("adam", "sgd"):
        problems.append(f"--datastates-interleaved-offload steps what --optimizer-cpu-offload offers, Adam/AdamW "
                        f"and SGD, not --optimizer {args.optimizer}")
    return problems


def install(args: Any) -> None:
    """Check the flags and make megatron-core build ``InterleavedOffloadOptimizer`` for HDO."""
    problems = _refusals(args)
    if problems:
        raise ValueError("invalid datastates configuration: " + "; ".join(problems))
    import megatron.core.optimizer as optimizer_package
    from megatron.core.optimizer import distrib_optimizer

    size = getattr(args, "datastates_offload_subgroup_numel", None)
    InterleavedOffloadOptimizer.subgroup_numel = size or DEFAULT_SUBGROUP_NUMEL
    optimizer_package.HybridDeviceOptimizer = InterleavedOffloadOptimizer
    distrib_optimizer.HybridDeviceOptimizer = InterleavedOffloadOptimizer
