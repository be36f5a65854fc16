"""Megatron-LM's own loop, 2 CPU ranks (DP = 2), ``--overlap-param-gather``: every rank ends the
interpreter (``sys.exit(0)``) right after iteration 2's save call. Nothing waits for that save
and no forward pass opens its copy gate; the engine's exit hook must run the parameter
all-gathers, commit it, and write the tracker. A resume from it must then train exactly as a run
that never stopped (so the all-gathered parameters were saved bit for bit).
"""

from __future__ import annotations

import json

from helpers.megatron_lm_runs import DATASTATES, assert_same_trajectory, read_tracker, run, trajectory
from megatron_ext.testing.megatron_lm import LLAMA_STYLE

# A Llama-style model (gated MLP, RMSNorm, rope, GQA), as users train, with the all-gathers held for the forward pass.
ARGS = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--save-interval", "1", "--train-iters", "4", "--logging-level", "20", *LLAMA_STYLE, *DATASTATES]


def test_exit_right_after_a_gated_save_commits_it(checkout, tmp_path):
    save = tmp_path / "ckpt"
    flags = [*ARGS, "--save", str(save), "--load", str(save)]
    stopped = run(checkout, 2, flags, tmp_path, "exit", exit_at=2)
    assert [r["iteration"] for r in stopped.records] == [1, 2]
    assert read_tracker(save) == "2"
    manifest = json.loads((save / "iter_0000002" / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["world_size"] == 2
    # It was the exit hook that settled the gate (the all-gathers ran there), on both ranks.
    assert stopped.log.count("iter_0000002's copies held for the parameter all-gathers of --overlap-param-gather "
                             "at the end: settled here") == 2, stopped.log[-4000:]
    resumed = run(checkout, 2, flags, tmp_path, "resume")
    assert resumed.records[0]["iteration"] == 3
    straight = run(checkout, 2, [*ARGS, "--save", str(tmp_path / "straight")], tmp_path, "straight")
    assert_same_trajectory(trajectory(stopped, resumed), trajectory(straight), "exit + resume vs uninterrupted")
