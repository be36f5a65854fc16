"""megatron_ext: lazy asynchronous multi-level checkpointing for Megatron-LM and DeepSpeed.

``megatron_ext.engine`` is framework-free; adapters (``megatron_ext.megatron``, the top-level
``datastates`` module for DeepSpeed) import it, never the reverse.
"""

__version__ = "0.1.0"
