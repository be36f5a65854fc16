"""Test and demo code: never imported by what a Megatron-LM or DeepSpeed user runs on GPUs.

* ``megatron_lm``: runs Megatron-LM's own ``pretrain_gpt.py`` on CPU ranks (gloo), records every
  iteration's loss and grad norm, and can SIGKILL every rank at a chosen iteration.
"""
