"""Megatron adapter: CPU emulation for tests, the reference trainer, and (later) checkpointing.

Nothing here is imported by ``megatron_ext.engine``; megatron-core is only needed by these modules.
"""
