"""The top-level ``datastates`` module DeepSpeed imports names this project's DeepSpeed engine."""

from __future__ import annotations


def test_deepspeed_imports_our_engine_under_its_name():
    import datastates
    from megatron_ext.deepspeed_adapter import DeepSpeedDataStatesEngine
    from megatron_ext.engine import CheckpointEngine

    assert datastates.CheckpointEngine is DeepSpeedDataStatesEngine
    assert DeepSpeedDataStatesEngine is not CheckpointEngine
