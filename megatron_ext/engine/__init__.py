"""The checkpoint engine: tensors in, durable committed files out. Knows nothing of Megatron.

Three rooms (docs/ARCHITECTURE.md):

- ``format/``: what is on disk. Names, the manifest and its validation, the catalog of committed
  checkpoints, the safetensors files and the sidecar codec.
- ``save/``: the save pipeline that ``CheckpointEngine`` (engine.py) drives: snapshot into the
  host cache, flush to each level, commit, overload skips, failures, retention, peer replicas.
- ``read/``: ``open_committed`` and the file readers, verify and inspect. Reading needs no engine
  and imports nothing of ``save/``.

Shared by both: errors.py, config.py, files.py, host_cache.py, device.py, collectives.py,
telemetry.py, faults.py.

The public names below resolve lazily (PEP 562), so that importing the read side through this
package does not import the save pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "CheckpointEngine": "engine", "CheckpointError": "errors", "ConfigError": "errors", "CopyGate": "save.flow.copy_gate",
    "EncodeError": "errors", "EngineConfig": "config", "Frozen": "format.codec", "OnFailure": "config", "OverloadPolicy": "config",
    "UnsafeCheckpointError": "errors", "add_safe_classes": "format.codec", "list_committed": "format.catalog",
    "open_committed": "read.committed", "read_manifest": "format.catalog", "safe_classes": "format.codec",
}

__all__ = [
    "CheckpointEngine", "CheckpointError", "ConfigError", "CopyGate", "EncodeError", "EngineConfig", "Frozen", "OnFailure",
    "OverloadPolicy", "UnsafeCheckpointError", "add_safe_classes", "list_committed", "open_committed", "read_manifest",
    "safe_classes",
]

if TYPE_CHECKING:
    from .config import EngineConfig, OnFailure, OverloadPolicy
    from .engine import CheckpointEngine
    from .errors import CheckpointError, ConfigError, EncodeError, UnsafeCheckpointError
    from .format.catalog import list_committed, read_manifest
    from .format.codec import Frozen, add_safe_classes, safe_classes
    from .read.committed import open_committed
    from .save.flow.copy_gate import CopyGate


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
