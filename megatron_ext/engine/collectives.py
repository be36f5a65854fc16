"""Small collectives on a device the process group's backend accepts.

NCCL, the backend of every GPU job, has no CPU path: an all-reduce of a host tensor fails with
``No backend type associated with device type cpu``; gloo takes host tensors. Every tensor
collective of the engine and the adapters goes through here, so the device is chosen in one
place: the one torch itself stages object collectives on for that group (``cuda`` for NCCL,
``cpu`` for gloo or a ``cpu:gloo,cuda:nccl`` group).
"""

from __future__ import annotations

from typing import Any

import torch


def collective_device(group: Any = None) -> torch.device:
    """The device a small tensor for a collective on ``group`` (default: the world) must live on."""
    import torch.distributed as dist

    try:
        kind = dist.distributed_c10d._get_object_coll_device(group)
    except (AttributeError, ValueError):  # a torch without the helper: decide by the backend's name
        kind = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def all_reduce_int(value: int, op: Any, group: Any = None) -> int:
    """``value`` reduced over ``group`` with ``op`` (a ``ReduceOp``), through a one-element tensor."""
    import torch.distributed as dist

    flag = torch.tensor([int(value)], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=op, group=group)
    return int(flag.item())
