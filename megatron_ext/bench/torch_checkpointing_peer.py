"""meta-pytorch's ``torch_checkpointing`` (0.1.1) as a peer in ``bench engine`` and ``bench python-loop``.

Its best documented setting (``CheckpointManager``'s and ``CheckpointStagerConfig``'s docstrings):
the default asynchronous saver, so ``save`` returns at once while a background thread stages the
state (``use_async_staging``) into shared-memory buffers (``use_shared_memory``) that its writer
subprocess writes from; the staging pool allocated once before the first save
(``prewarm_staging``); and the in-place update wrapped in ``manager.lock()``, which waits only
while a capture is still running. A new save first waits for the previous write (one checkpoint in
flight), as DCP does here. On a GPU it pins its buffers and copies without blocking (its defaults
there); on a CPU both need CUDA and are off. Its local writer runs without ``O_DIRECT``
(``use_direct_io=False``): the default one fails on these disks with EINVAL on unaligned writes.

The writer subprocess is started with ``spawn``, which re-imports the caller's main module: the
benches call it from modules guarded by ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import os

PACKAGE = "torch_checkpointing"
#: The version pinned in requirements/cpu.txt, the one this setting was read from.
VERSION = "0.1.1"


def missing() -> str | None:
    """Why the peer cannot run here (None: it can)."""
    try:
        import torch_checkpointing
    except ImportError as exc:
        return f"{PACKAGE} is not installed ({exc}); pip install {PACKAGE}=={VERSION}"
    found = getattr(torch_checkpointing, "__version__", "unknown")
    if str(found) != VERSION:
        return f"{PACKAGE} {found} is installed; this setting was read from {VERSION}"
    return None


def manager(device: str = "cpu"):
    """A ``CheckpointManager`` at the setting above for state on ``device`` (``cpu`` or ``cuda``)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    gpu = device == "cuda"
    staging = CheckpointStagerConfig(use_pinned_memory=gpu, use_shared_memory=True, use_async_staging=True,
                                     use_non_blocking_copy=gpu)
    return CheckpointManager.Config(save=AsyncCheckpointSaverConfig(staging_config=staging),
                                    storage_config=LocalFileSystemStorageConfig(use_direct_io=False)).build()


class Saver:
    """One manager kept for a run: ``save`` per checkpoint, ``update`` around the in-place update."""

    def __init__(self, state: dict, directory: str, device: str = "cpu"):
        self.directory = directory
        self.manager = manager(device)
        self.manager.prewarm_staging({"model": state})
        self.write = None

    def save(self, state: dict, name: str):
        """Starts one checkpoint of ``state``; returns its write future (done: on disk)."""
        self.write = self.manager.save(os.path.join(self.directory, name), {"model": state})
        return self.write

    def update(self):
        """The context to change the saved tensors in: waits while a capture runs."""
        return self.manager.lock()

    def close(self) -> None:
        if self.write is not None:
            self.write.result()
        self.manager.close()
