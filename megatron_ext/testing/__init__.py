"""Test and demo code: never imported by what a Megatron-LM or DeepSpeed user runs on GPUs.

* ``megatron_lm``: runs Megatron-LM's own ``pretrain_gpt.py`` on CPU ranks (gloo), records every
  iteration's loss and grad norm, and can SIGKILL every rank at a chosen iteration.
* ``main_job``: the README's main job (``megatron-ext main-job``, ``scripts/run_main.sh``):
  ``pretrain_gpt.py`` through ``megatron_lm`` with ``--use-datastates --save-interval 1``, SIGKILL,
  resume, bit-exact comparison; the reference trainer when the checkout is missing.
"""
