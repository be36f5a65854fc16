"""``--optimizer-cpu-offload`` (megatron-core's hybrid device optimizer) in Megatron-LM's own loop, on 2 CPU ranks.

The hybrid device optimizer (HDO) keeps the fp32 masters and Adam moments in its sub-optimizers
(a CPU one for the offloaded half here, ``--optimizer-offload-fraction 0.5``, a device one for the
rest) and copies the masters back over the model's weights after every step; ``HDO.state`` is
only its view of them. A load that sets that view without passing it on to the sub-optimizers
(megatron-core's ``_sync_hdo_state_to_sub_optimizers``) leaves them stepping stale masters,
which the next step copies over the loaded weights: the step after the resume is right, the one
after it is not. A data-parallel resize (DP 2 -> DP 1) loads every value from the checkpoint,
none of it into the optimizer's own tensors, so it shows; Megatron-LM's own torch_dist
checkpointing doing the same is the oracle, bit for bit. The harness runs the HDO on CPU ranks as
on GPUs (``megatron_ext.testing.megatron_lm._hybrid_optimizer_on_cpu``).
"""

from __future__ import annotations

from helpers.megatron_lm_runs import DATASTATES, NATIVE, assert_same_trajectory, run, trajectory

CPU_OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.5"]
COMMON = ["--bf16", "--use-distributed-optimizer", *CPU_OFFLOAD, "--train-iters", "5", "--save-interval", "1"]


def test_resharded_resume_with_optimizer_cpu_offload_matches_megatron(checkout, tmp_path):
    results = {}
    for side, flags in {"datastates": DATASTATES, "torch_dist": NATIVE}.items():
        save = tmp_path / side / "ckpt"
        args = [*COMMON, "--save", str(save), "--load", str(save), *flags]
        saved = run(checkout, 2, [*args, "--exit-interval", "3"], tmp_path / side, "save_dp2")
        resumed = run(checkout, 1, args, tmp_path / side, "resume_dp1")
        results[side] = (saved, resumed)
    ours, theirs = results["datastates"], results["torch_dist"]
    assert [r["iteration"] for r in ours[1].records] == [4, 5]
    assert "resharding iter_0000003" in ours[1].log
    assert_same_trajectory(trajectory(*ours), trajectory(*theirs),
                           "--optimizer-cpu-offload, DP 2 -> DP 1: datastates vs torch_dist")
