"""The module DeepSpeed imports for ``"datastates_ckpt": {...}``: ``from datastates import CheckpointEngine``.

Installed with megatron_ext; ``CheckpointEngine`` here is the name DeepSpeed looks up, for
``megatron_ext.deepspeed_adapter.DeepSpeedDataStatesEngine`` (not the engine's own
``megatron_ext.engine.CheckpointEngine``).
"""

from megatron_ext.deepspeed_adapter import DeepSpeedDataStatesEngine as CheckpointEngine

__all__ = ["CheckpointEngine"]
