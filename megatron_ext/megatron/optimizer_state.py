"""The distributed optimizer's state as the lazy snapshot sees it, and two load-time repairs.

Saving: megatron-core's ``dp_reshardable`` sharded state dict of a ``DistributedOptimizer`` is
built from ``get_parameter_state_dp_reshardable``, which returns this data-parallel rank's fp32
main params and Adam moments *as views* of the optimizer's own tensors. The snapshot therefore
copies straight from the optimizer's memory: no gather, no staging copy. ``owned_state_views``
exposes those views (tests check they alias the optimizer's storage).

Loading, on the torch-Adam path (no Transformer Engine or Apex, as on CPUs):

* a fresh optimizer has no Adam state yet, and ``DistributedOptimizer.state_dict()`` fails
  without it, so ``ensure_state`` allocates it (values are overwritten by the load);
* after the load every param shares one ``step`` tensor holding the pre-load value, so
  ``restore_adam_steps`` gives each param its own ``step`` equal to the checkpointed count kept
  in ``param_groups[i]['step']``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def _distributed(optimizer: Any) -> Iterator[Any]:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield opt


def owned_state_views(optimizer: Any) -> list[torch.Tensor]:
    """This rank's fp32 main params and Adam moments, as zero-copy views."""
    views = []
    for opt in _distributed(optimizer):
        if not hasattr(opt, "get_parameter_state_dp_reshardable"):
            continue
        state = opt.get_parameter_state_dp_reshardable()
        for key, per_dtype in state.items():
            if not isinstance(key, int):
                continue
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        views += [v for v in entry.values() if isinstance(v, torch.Tensor)]
    return views


def ensure_state(optimizer: Any) -> None:
    for opt in _distributed(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and len(inner.state) == 0 and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


def restore_adam_steps(optimizer: Any) -> None:
    for opt in _distributed(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
