"""Test and demo code: never imported by what a Megatron-LM or DeepSpeed user runs on GPUs.

* ``reference_trainer``: a small megatron-core GPT with TP/PP/DP, deterministic data and both
  checkpointing paths (``torchrun -m megatron_ext.testing.reference_trainer``).
* ``cpu_emulation``: lets megatron-core train on CPU ranks (gloo); builds on the product's
  ``megatron_ext.megatron.cpu_device``.
* ``megatron_lm``: runs Megatron-LM's own ``pretrain_gpt.py`` on CPU ranks (gloo), records every
  iteration's loss and grad norm, and can SIGKILL every rank at a chosen iteration.
* ``deepspeed_harness``: a tiny model trained with real DeepSpeed on CPU ranks, saving through
  ``datastates`` or DeepSpeed's own engine.
* ``commit_wait``: crash tests wait (bounded) for a committed checkpoint before the kill, so a
  loaded machine's slower commits cannot leave nothing to resume from.
* ``torch_dist_layout``: a megatron-core ``torch_dist`` checkpoint of any TP x PP x DP layout (the
  180-GPU template's, for ``convert``), every rank's shards saved by megatron-core from one process.
* ``s3_server``: a real S3 server (SeaweedFS's ``weed mini`` on loopback ports) for the object-store
  level's tests and ``bench object-store``: identities, kill, restart, pause (SIGSTOP).
* ``demo``: the engine alone on a toy model (``megatron-ext demo``).
* ``main_job``: the README's main job (``megatron-ext main-job``, ``scripts/run_main.sh``):
  ``pretrain_gpt.py`` through ``megatron_lm`` with ``--use-datastates --save-interval 1``, SIGKILL,
  resume, bit-exact comparison; the reference trainer when the checkout is missing.
"""
