"""Megatron-LM adapter: what a Megatron-LM user runs (drop-in ``save_checkpoint``/``load_checkpoint``,
the ``--datastates-*`` flags, resharding, conversion to and from ``torch_dist``, export).

Nothing here is imported by ``megatron_ext.engine``; megatron-core is only needed by these modules.
Test and demo code (the reference trainer, the CPU emulation) lives in ``megatron_ext.testing``.
"""
