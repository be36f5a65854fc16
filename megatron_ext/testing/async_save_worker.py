"""``--async-save``'s persistent checkpoint worker (megatron-core's ``PersistentAsyncCaller``) on CPU ranks.

Megatron-LM runs ``--async-save`` only with ``--use-persistent-ckpt-worker`` (``validate_args``
switches it off otherwise): one worker process per rank, started with ``forkserver``, so none of
the harness's CPU answers reach it. Its loop starts with
``torch.cuda.set_device(rank % torch.cuda.device_count())``, a division by zero on a CPU (the
worker dies and its rank waits for it forever), and syncs CUDA after its host copies. Its loop runs
through ``async_loop`` here, a module the worker can import (the harness itself is ``__main__``),
which gives the worker the CPU answers its loop needs first.

On CPU ranks the worker's host copy (``preload_tensors``: ``tensor.to("cpu")``) copies nothing: the
tensors already live in host memory and reach the worker through shared memory (torch moves a
tensor's storage there when it is first sent). On a GPU that copy is the device-to-host staging.
"""

from __future__ import annotations

from typing import Any

import torch


def install() -> None:
    """Route megatron-core's worker loop through ``async_loop`` (on the ranks, before the worker starts)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    PersistentAsyncCaller.async_loop = staticmethod(async_loop)


def async_loop(*args: Any, **kwargs: Any) -> None:
    """megatron-core's worker loop, in the worker process, after the CPU answers its loop needs: the device
    mode (``enable_cpu_emulation``), one device to pick, and CUDA syncs that return at once.

    The worker imports megatron-core afresh: its ``PersistentAsyncCaller.async_loop`` is the original.
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    from megatron_ext.testing.cpu_emulation import enable_cpu_emulation

    if PersistentAsyncCaller.async_loop is async_loop:  # not a fresh import after all: no loop to call
        raise RuntimeError("the async checkpoint worker shares the rank's megatron-core: cannot find its loop")
    enable_cpu_emulation()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    return PersistentAsyncCaller.async_loop(*args, **kwargs)
