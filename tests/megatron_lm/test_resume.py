"""SIGKILL and resume in Megatron-LM's own loop, a Llama-style model at TP2 x PP2 x DP2: ours against torch_dist.

The model is gated (SwiGLU), with RMSNorm, rotary embeddings, grouped-query attention and untied
embeddings, as the models users train, with the distributed optimizer's communication overlapped;
the default process group is ``nccl`` (the harness's
emulation refuses host tensors as NCCL does). Every rank SIGKILLs itself right after iteration 3's
save call, which waits until iteration 1 is committed (commits trail the saves, and on a loaded
machine by more than two iterations); with ``--use-datastates`` iteration 3's copies and flushes
are still in flight, so the restart loads the newest committed checkpoint (the tracker's). Both
runs' per-iteration losses, grad norms and learning rates must be bit-identical to Megatron-LM's
own checkpointing doing the same, including the iterations the restart repeats.
"""

from __future__ import annotations

import re

from helpers.megatron_lm_runs import DATASTATES, NATIVE, Phase, assert_same_trajectory, run_scenario
from megatron_ext.testing.megatron_lm import LLAMA_STYLE

ITERS = 6
KILL_AT = 3
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# As users run the distributed optimizer: gradient reduce and parameter all-gather overlapped (ours
# skips Megatron-LM's forced all-gather before each save, patch 0004).
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
COMMON = ["--bf16", "--use-distributed-optimizer", *OVERLAP, "--save-interval", "1", "--train-iters", str(ITERS),
          *LAYOUT, *LLAMA_STYLE]


def test_llama_style_sigkill_resume_tp2_pp2_dp2_matches_megatron_torch_dist(checkout, tmp_path):
    phases = [Phase([], kill_at=KILL_AT, committed_before_kill=KILL_AT - 2), Phase([])]
    ours = run_scenario(checkout, 8, phases, tmp_path / "datastates", DATASTATES, COMMON)
    theirs = run_scenario(checkout, 8, phases, tmp_path / "torch_dist", NATIVE, COMMON)

    committed_at_kill = int(ours.trackers[0])
    assert KILL_AT - 2 <= committed_at_kill <= KILL_AT  # at most the ones in flight are lost
    assert ours.runs[1].first_iteration == committed_at_kill + 1  # resumed from the committed one
    assert theirs.runs[1].first_iteration == KILL_AT + 1  # Megatron's save returns once written
    assert list(ours.trajectory) == list(range(1, ITERS + 1))
    assert_same_trajectory(ours.trajectory, theirs.trajectory, "datastates vs torch_dist")
    assert ours.trackers[-1] == str(ITERS)
    # The load's log line says what each step took, the read among them.
    assert re.search(r"\[datastates\] loaded iter_\d{7} from .* in [\d.]+s \(open [\d.]+s, meta [\d.]+s, "
                     r"allocate [\d.]+s, template [\d.]+s, read [\d.]+s, model [\d.]+s, optimizer [\d.]+s, "
                     r"rng [\d.]+s\): iteration \d+", ours.runs[1].log)
