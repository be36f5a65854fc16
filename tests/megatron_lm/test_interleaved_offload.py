"""``--datastates-interleaved-offload`` in Megatron-LM's own loop, on 2 CPU ranks (bf16, distributed optimizer).

The interleaved optimizer must give the hybrid device optimizer's (HDO, ``--optimizer-cpu-offload``
at fraction 1.0) trajectory bit for bit, and the checkpoints of either must resume the other:
with ``--use-datastates`` and a save every iteration, a run that stops at iteration 3 is resumed
to 6 with the flag flipped, both ways, a SIGKILLed run resumes with the flag, and each joined
trajectory is HDO's uninterrupted one; a DP 2 -> DP 1 resume into another subgroup size is HDO's;
a Llama-style TP2 x PP2 x DP2 run SIGKILLed and resumed (slow) is HDO's uninterrupted one.
"""

from __future__ import annotations

import pytest

from helpers.megatron_lm_runs import DATASTATES, assert_same_trajectory, run, trajectory, without_flags
from megatron_ext.testing.megatron_lm import LLAMA_STYLE, TINY_GPT

CPU_OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
INTERLEAVED = ["--datastates-interleaved-offload", "--datastates-offload-subgroup-numel", "4096",
               "--logging-level", "20"]
COMMON = ["--bf16", "--use-distributed-optimizer", *CPU_OFFLOAD, "--train-iters", "6", "--save-interval", "1",
          *DATASTATES]


def test_interleaved_offload_matches_hdo_and_resumes_across_the_flag(checkout, tmp_path):
    hdo = run(checkout, 2, [*COMMON, "--save", str(tmp_path / "hdo" / "ckpt")], tmp_path / "hdo", "hdo")
    reference = trajectory(hdo)
    assert list(reference) == [1, 2, 3, 4, 5, 6]
    for first, then, name in ((INTERLEAVED, [], "interleaved_then_hdo"), ([], INTERLEAVED, "hdo_then_interleaved")):
        save = tmp_path / name / "ckpt"
        args = [*COMMON, "--save", str(save), "--load", str(save)]
        stopped = run(checkout, 2, [*args, *first, "--exit-interval", "3"], tmp_path / name, "first")
        resumed = run(checkout, 2, [*args, *then], tmp_path / name, "resumed")
        assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
        interleaved_log = (stopped if first else resumed).log
        assert "subgroups on the GPU, step predicted" in interleaved_log, name
        assert_same_trajectory(trajectory(stopped, resumed), reference, f"{name} vs HDO uninterrupted")
    # SIGKILL after iteration 3 (at least iteration 1 committed), resumed from whatever was committed
    save = tmp_path / "sigkill" / "ckpt"
    args = [*COMMON, *INTERLEAVED, "--save", str(save), "--load", str(save)]
    killed = run(checkout, 2, args, tmp_path / "sigkill", "killed", kill_at=3, committed_before_kill=1)
    resumed = run(checkout, 2, args, tmp_path / "sigkill", "resumed")
    assert 2 <= resumed.first_iteration <= 4
    assert_same_trajectory(trajectory(killed, resumed), reference, "interleaved SIGKILL resume vs HDO uninterrupted")


# With --run-slow, to keep the default run near 30 minutes: the DP 2 -> 1 reshard of the optimizer state is
# HDO's own code (the subclass only replaces ``step``), and the other subgroup size is also checked there.
@pytest.mark.slow
def test_interleaved_offload_reshards_dp2_to_dp1_into_another_split_as_hdo(checkout, tmp_path):
    """DP 2 -> DP 1 with the flag on both sides and another subgroup size after the resume: HDO's own
    resharded resume, bit for bit."""
    resplit = without_flags(INTERLEAVED, "--datastates-offload-subgroup-numel") + [
        "--datastates-offload-subgroup-numel", "1000"]
    results = {}
    for side, (before, after) in {"hdo": ([], []), "interleaved": (INTERLEAVED, resplit)}.items():
        save = tmp_path / side / "ckpt"
        args = [*COMMON, "--save", str(save), "--load", str(save)]
        saved = run(checkout, 2, [*args, *before, "--exit-interval", "3"], tmp_path / side, "save_dp2")
        resumed = run(checkout, 1, [*args, *after], tmp_path / side, "resume_dp1")
        assert [r["iteration"] for r in resumed.records] == [4, 5, 6]
        results[side] = trajectory(saved, resumed)
    assert_same_trajectory(results["interleaved"], results["hdo"], "DP 2 -> 1: interleaved (resplit) vs HDO")


@pytest.mark.slow
def test_llama_style_tp2_pp2_dp2_interleaved_offload_sigkill_resume_matches_hdo(checkout, tmp_path):
    """Llama-style (SwiGLU, RMSNorm, rope, GQA) at TP2 x PP2 x DP2 on 8 ranks, SIGKILLed after iteration 3
    and resumed from what was committed: HDO's uninterrupted trajectory bit for bit."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--train-iters", "5"]
    model = [*TINY_GPT, *LLAMA_STYLE]
    base = [a for a in COMMON if a not in ("--train-iters", "6")] + layout
    hdo = run(checkout, 8, [*base, "--save", str(tmp_path / "hdo")], tmp_path, "hdo", model=model)
    assert list(trajectory(hdo)) == [1, 2, 3, 4, 5]
    save = tmp_path / "ours"
    ours = [*base, *INTERLEAVED, "--save", str(save), "--load", str(save)]
    killed = run(checkout, 8, ours, tmp_path, "killed", model=model, kill_at=3, committed_before_kill=1)
    resumed = run(checkout, 8, ours, tmp_path, "resumed", model=model)
    assert 2 <= resumed.first_iteration <= 4
    assert "subgroups on the GPU, step predicted" in killed.log + resumed.log
    assert_same_trajectory(trajectory(killed, resumed), trajectory(hdo),
                           "TP2 x PP2 x DP2: interleaved SIGKILL resume vs HDO uninterrupted")
