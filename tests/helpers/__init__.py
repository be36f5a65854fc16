"""Test plumbing shared by the test directories, imported as ``helpers.<module>`` (``tests/`` is on
``sys.path``: ``pythonpath`` in setup.cfg; children get it from ``procs.child_env``).

* ``procs``: the repository paths, the children's environment, the one torchrun launcher and
  free-port helper (``megatron_ext.procs``), running a worker program.
* ``states``: deterministic state builders, bit-exact comparison, the small engine settings.
* ``damage``: damaging checkpoint files in place (flipped bits, overwritten bytes, truncation).
* ``trainer_runs``: the reference trainer under torchrun on CPU ranks.
* ``megatron_lm_runs``: Megatron-LM's own ``pretrain_gpt.py`` runs, ours against Megatron's.
* ``hostile``: the hostile-checkpoint suite's library (genuine checkpoints, re-sealing, audit hook).
* ``device_scenarios``: the restore scenarios run on a GPU (``tests/gpu``) and on the CPU.
* ``slurm_cluster``: a real one-node Slurm in a private directory.
* ``s3_fixtures``: the object-store tests' fixtures (a pytest plugin): one S3 server per test run,
  a fresh bucket per test (``s3_server``, ``s3_bucket``, ``s3_root``).
"""
