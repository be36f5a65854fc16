"""The checkpoint engine: tensors in, durable committed files out. Knows nothing of Megatron."""

from .codec import EncodeError, UnsafeCheckpointError, add_safe_classes, safe_classes
from .commit import list_committed, read_manifest
from .config import ConfigError, EngineConfig
from .engine import CheckpointEngine
from .jobs import CheckpointError

__all__ = [
    "CheckpointEngine", "CheckpointError", "ConfigError", "EncodeError", "EngineConfig",
    "UnsafeCheckpointError", "add_safe_classes", "list_committed", "read_manifest", "safe_classes",
]
