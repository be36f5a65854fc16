"""The module DeepSpeed imports for ``"datastates_ckpt": {...}``: ``from datastates import CheckpointEngine``.

Installed with megatron_ext; the implementation is ``megatron_ext.deepspeed_adapter``.
"""

from megatron_ext.deepspeed_adapter import CheckpointEngine

__all__ = ["CheckpointEngine"]
