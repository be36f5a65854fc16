"""The flags Megatron-LM users checkpoint with, in its own loop: ours against Megatron's torch_dist (slow).

Each scenario runs its phases (stops, kills, restarts) once with ``--use-datastates`` and once
with Megatron-LM's own checkpointing; the per-iteration trajectories must be bit-identical, and
where the scenario changes nothing about the training itself, also equal to one uninterrupted
run without checkpoints. Run with ``--run-slow`` (about 20-40 minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest
import torch

from helpers.megatron_lm_runs import (DATASTATES, NATIVE, STEP_FIELDS, Phase, assert_same_saved_tensors,
                                      assert_same_trajectory, copy_checkpoints, read_tracker, run, run_scenario,
                                      saved_tensor, trajectory, without_flags)
from helpers.procs import python_command
from megatron_ext.testing.megatron_lm import LLAMA_STYLE, TINY_GPT

pytestmark = pytest.mark.slow

BF16_DIST = ["--bf16", "--use-distributed-optimizer"]
ITERS = ["--train-iters", "6"]
KILL_RESUME = [Phase([], kill_at=3), Phase([])]
LION = ["--bf16", "--optimizer", "lion"]
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--moe-token-dispatcher-type", "alltoall"]


@dataclasses.dataclass
class Scenario:
    common: list[str]
    phases: list[Phase]
    nproc: int = 2
    uninterrupted: bool = True  # the scenario leaves training unchanged: compare with a run without checkpoints
    uninterrupted_args: list[str] = dataclasses.field(default_factory=list)  # replaces ITERS for that run
    # Megatron-LM's own checkpointing can run it on CPUs (see fp16_first_steps_skipped).
    native: bool = True
    model: list[str] = dataclasses.field(default_factory=lambda: list(TINY_GPT))
    # Tensors that must be saved bit-identical to torch_dist's in every iteration both committed.
    same_tensors: list[str] = dataclasses.field(default_factory=list)


def _with(flags: list[str], option: str, value: str) -> list[str]:
    """``flags`` with ``option``'s value replaced."""
    return [value if i and flags[i - 1] == option else a for i, a in enumerate(flags)]


SCENARIOS = {
    "exit_interval": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1"],
                              [Phase(["--exit-interval", "3"]), Phase([])]),
    "exit_signal_handler_sigterm": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--exit-signal-handler"],
                                            [Phase([], sigterm_at=3), Phase([])]),
    "exit_duration_in_mins": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1"],
                                      [Phase(["--exit-duration-in-mins", "30"], expire_at=3), Phase([])]),
    # Saves at 4 and, at the end, 6; the second run goes on to 8 from the final checkpoint.
    "final_save_off_interval": Scenario([*BF16_DIST, "--save-interval", "4"],
                                        [Phase(ITERS), Phase(["--train-iters", "8", "--override-opt_param-scheduler"])],
                                        uninterrupted_args=["--train-iters", "8"]),
    "no_load_rng": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1"],
                            [Phase(["--exit-interval", "3"]), Phase(["--no-load-rng"])], uninterrupted=False),
    "non_persistent_global": Scenario([*BF16_DIST, *ITERS, "--save-interval", "4", "--non-persistent-save-interval",
                                       "1", "--non-persistent-ckpt-type", "global"],
                                      [Phase([], kill_at=5), Phase([])]),
    # The scale doubles after every good step until the grads overflow, then that step is skipped
    # and the scale halves: the scaler's state (scale, growth tracker, hysteresis) must resume exactly.
    "fp16_dynamic_loss_scale": Scenario(["--fp16", "--use-distributed-optimizer", "--initial-loss-scale", "131072",
                                         "--loss-scale-window", "1", "--hysteresis", "1", "--train-iters", "8",
                                         "--save-interval", "1"], [Phase([], kill_at=4), Phase([])]),
    # A scale far too large: the first steps are skipped, so the first checkpoints hold an optimizer
    # that has not stepped yet. Megatron-LM cannot save that on CPUs (megatron-core's state_dict()
    # asserts over torch Adam's empty state; GPU runs use a fused Adam), so this compares with an
    # uninterrupted run only.
    "fp16_first_steps_skipped": Scenario(["--fp16", "--use-distributed-optimizer", "--initial-loss-scale", "4294967296",
                                          "--hysteresis", "1", "--train-iters", "8", "--save-interval", "1"],
                                         [Phase([], kill_at=2), Phase([])], native=False),
    "fp32": Scenario(["--use-distributed-optimizer", *ITERS, "--save-interval", "1"], KILL_RESUME),
    # Flags users of Megatron-LM's own async save pass: the torch_dist plan cache (no effect on ours) and
    # multi-storage-client for Megatron-LM's own file access, checkpoints on a file system.
    "constant_structure_msc": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--ckpt-assume-constant-structure",
                                        "--enable-msc"], KILL_RESUME),
    "plain_optimizer": Scenario(["--bf16", *ITERS, "--save-interval", "1"], KILL_RESUME),
    # Megatron-LM all-gathers the parameters before its save; ours skips that (patch 0004) and its
    # copies wait for the next forward pass's all-gathers: the saved weights must be the same.
    "overlap_grad_reduce_param_gather": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--overlap-grad-reduce",
                                                  "--overlap-param-gather"], KILL_RESUME,
                                                 same_tensors=["embedding.word_embeddings.weight",
                                                               "decoder.layers.mlp.linear_fc1.weight"]),
    # The same on the model users train (gated MLP, RMSNorm, rope, GQA, untied output layer), with the
    # param sync core_v0.19.0 runs at its saves (prepare_model_params_for_param_sync, then every
    # bucket group's forced all-gather; free_overlap_buffers after it), which patch 0004 skips.
    "llama_overlap_param_gather": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--overlap-grad-reduce",
                                            "--overlap-param-gather"], KILL_RESUME,
                                           model=[*TINY_GPT, *LLAMA_STYLE],
                                           same_tensors=["decoder.layers.mlp.linear_fc1.weight",
                                                         "decoder.layers.self_attention.linear_qkv.weight",
                                                         "output_layer.weight"]),
    # PP = 4 without overlapped p2p: with overlap (which PP = 2 requires) megatron-core's
    # interleaved schedule is not deterministic over gloo, checkpoints or not.
    "interleaved_pipeline": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--pipeline-model-parallel-size", "4",
                                      "--num-layers-per-virtual-pipeline-stage", "1",
                                      "--no-overlap-p2p-communication"], KILL_RESUME, nproc=4,
                                     model=_with(TINY_GPT, "--num-layers", "8")),
    "untied_embeddings_pp2": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--pipeline-model-parallel-size",
                                       "2", "--untie-embeddings-and-output-weights"], KILL_RESUME),
    "moe_expert_parallel": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", *MOE], KILL_RESUME),
    # Aux-loss-free routing (DeepSeek-V3): finalize_model_grads updates every router's expert_bias
    # in place before the optimizer step. The copies start as late as the lazy contract allows
    # (at the optimizer's wait, after that update); a fast update rate makes routing feel it.
    "moe_router_expert_bias": Scenario(
        [*BF16_DIST, *ITERS, "--save-interval", "1", *MOE, "--moe-router-enable-expert-bias",
         "--moe-router-score-function", "sigmoid", "--moe-router-bias-update-rate", "0.1"],
        [Phase([], kill_at=4, late_copies=True), Phase([], late_copies=True)],
        same_tensors=["decoder.layers.mlp.router.expert_bias"]),
    # megatron-core's hybrid device optimizer: half of the fp32 masters and moments in a CPU
    # sub-optimizer (one per parameter with the overlap flag), stepped there and copied back.
    "optimizer_cpu_offload": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--optimizer-cpu-offload",
                                       "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.5",
                                       "--overlap-cpu-optimizer-d2h-h2d"], KILL_RESUME),
    # --datastates-interleaved-offload: the same optimizer at fraction 1.0, its step split between the
    # "GPU" (staged through the deferring stand-in for CUDA streams) and the CPU by the performance model.
    "interleaved_offload": Scenario([*BF16_DIST, *ITERS, "--save-interval", "1", "--optimizer-cpu-offload",
                                     "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d",
                                     "--datastates-interleaved-offload", "--datastates-offload-subgroup-numel",
                                     "4096"], KILL_RESUME),
    # --optimizer lion (emerging-optimizers): megatron-core chains Lion (one moment, exp_avg) for the linear
    # weights and Adam for the other parameters, both non-distributed (with --use-distributed-optimizer it
    # is the layer-wise optimizer, refused). Megatron-LM's own torch_dist saves and loads it on CPUs.
    "lion": Scenario([*LION, *ITERS, "--save-interval", "1"], KILL_RESUME, model=[*TINY_GPT, *LLAMA_STYLE],
                     same_tensors=["decoder.layers.mlp.linear_fc1.weight", "output_layer.weight"]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_matches_megatron_torch_dist(checkout, tmp_path, name):
    scenario = SCENARIOS[name]
    ours = run_scenario(checkout, scenario.nproc, scenario.phases, tmp_path / "datastates", DATASTATES, scenario.common,
                        model=scenario.model)
    theirs = None
    if scenario.native:
        theirs = run_scenario(checkout, scenario.nproc, scenario.phases, tmp_path / "torch_dist", NATIVE,
                              scenario.common, model=scenario.model)
        assert_same_trajectory(ours.trajectory, theirs.trajectory, f"{name}: datastates vs torch_dist")
        assert ours.trackers[-1] == theirs.trackers[-1], (ours.trackers, theirs.trackers)
        if scenario.same_tensors:
            assert_same_saved_tensors(ours.save_dir, theirs.save_dir, scenario.same_tensors, name)
    if name.startswith("fp16"):
        assert any(step[STEP_FIELDS.index("skipped")] for step in ours.trajectory.values()), "no step was skipped"
    if scenario.uninterrupted:
        args = [a for a in scenario.common if a not in ITERS] if scenario.uninterrupted_args else scenario.common
        straight = run(checkout, scenario.nproc, [*args, *scenario.uninterrupted_args], tmp_path, "uninterrupted",
                       model=scenario.model)
        assert_same_trajectory(ours.trajectory, trajectory(straight), f"{name}: datastates vs no checkpoints")
    print(f"{name}: {len(ours.trajectory)} iterations identical; datastates trackers {ours.trackers}, "
          f"torch_dist trackers {theirs.trackers if theirs else 'not run'}")


def test_load_into_another_data_parallel_size(checkout, tmp_path):
    """Saved at DP 2, resumed at DP 4 inside Megatron-LM: ours against Megatron's own (dp_reshardable) format."""
    common = [*BF16_DIST, *ITERS, "--save-interval", "1"]
    results = {}
    for side, flags in {"datastates": DATASTATES, "torch_dist": NATIVE}.items():
        save = tmp_path / side / "ckpt"
        args = [*common, "--save", str(save), "--load", str(save), *flags]
        run(checkout, 2, [*args, "--exit-interval", "3"], tmp_path / side, "save_dp2")
        results[side] = run(checkout, 4, args, tmp_path / side, "resume_dp4")
    assert results["datastates"].records[0]["iteration"] == 4
    assert "resharding iter_0000003" in results["datastates"].log
    assert_same_trajectory(trajectory(results["datastates"]), trajectory(results["torch_dist"]),
                           "DP 2 -> DP 4: datastates vs torch_dist")


def _reshard_against_torch_dist(checkout, tmp_path, common: list[str], saved: list[str], what: str) -> None:
    """Saved on the ``saved`` layout at iteration 3, resumed on ``common``'s to 6: ours against Megatron-LM's
    own torch_dist doing the same from its ``fully_reshardable`` optimizer format, bit for bit.

    (The harness makes megatron-core's loader of that format work with torch's Adam on CPUs,
    ``_torch_adam_loads_fully_reshardable``; resharding across TP is then exact on both sides: the
    same model-space values go to the same parameters.)
    """
    results = {}
    for side, flags in {"datastates": DATASTATES, "torch_dist": [*NATIVE, "--dist-ckpt-optim-fully-reshardable"]}.items():
        save = tmp_path / side / "ckpt"
        args = [*common, "--save", str(save), "--load", str(save), *flags]
        before = run(checkout, 4, [*args, *saved, "--exit-interval", "3"], tmp_path / side, "saved_layout")
        after = run(checkout, 4, args, tmp_path / side, "resumed_layout")
        results[side] = (before, after)
    ours, theirs = results["datastates"], results["torch_dist"]
    assert "resharding iter_0000003" in ours[1].log
    assert [r["iteration"] for r in ours[1].records] == [4, 5, 6]
    assert_same_trajectory(trajectory(*ours), trajectory(*theirs), f"{what}: datastates vs torch_dist")


def test_load_into_another_tensor_parallel_layout(checkout, tmp_path):
    """Saved at TP2 x DP2, resumed at TP1 x DP4 inside Megatron-LM: bit-identical to Megatron-LM's own reshard."""
    _reshard_against_torch_dist(checkout, tmp_path, [*BF16_DIST, *ITERS, "--save-interval", "1"],
                                ["--tensor-model-parallel-size", "2"], "TP2 x DP2 -> TP1 x DP4")


def _convert(*args: str) -> dict:
    proc = subprocess.run(python_command("-m", "megatron_ext", "convert", *args, "--json"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_convert_cli_round_trip_resumes_in_megatron(checkout, tmp_path):
    """``megatron-ext convert --to torch_dist``: Megatron-LM resumes it natively; converted back to
    ours (datastates -> torch_dist -> datastates), Megatron-LM resumes that bit-exactly against the
    original; and Megatron-LM's own checkpoint converted to ours resumes too."""
    common = [*BF16_DIST, *ITERS, "--save-interval", "1"]
    ours_dir = tmp_path / "ours"
    base = run_scenario(checkout, 2, [Phase(["--exit-interval", "3"])], ours_dir, DATASTATES, common)
    reference = run(checkout, 2, [*common, "--save", str(copy_checkpoints(base.save_dir, tmp_path / "ref")),
                                  "--load", str(tmp_path / "ref"), *DATASTATES], tmp_path, "datastates_resume")
    convert = _convert

    native_dir = tmp_path / "native"
    summary = convert(str(base.save_dir), str(native_dir), "--to", "torch_dist", "--iteration", "3")
    assert summary["optimizer_format"] == "fully_reshardable"
    assert read_tracker(native_dir) == "3"

    # The full round trip: our checkpoint, through torch_dist, back to ours, resumed by Megatron-LM.
    round_trip = tmp_path / "round_trip"
    summary = convert(str(native_dir / "iter_0000003"), str(round_trip), "--to", "datastates")
    assert summary["optimizer_format"] == "fully_reshardable" and summary["iteration"] == 3
    again = run(checkout, 2, [*common, "--save", str(round_trip), "--load", str(round_trip), *DATASTATES], tmp_path,
                "round_trip_resume")
    assert_same_trajectory(trajectory(again), {k: v for k, v in trajectory(reference).items() if k > 3},
                           "datastates -> torch_dist -> datastates, resumed by Megatron-LM")
    # Megatron-LM resumes the converted checkpoint natively and writes iteration 4 itself.
    native = run(checkout, 2, [*common, "--save", str(native_dir), "--load", str(native_dir), *NATIVE,
                               "--exit-interval", "4"], tmp_path, "native_resume")
    assert_same_trajectory(trajectory(native), {4: trajectory(reference)[4]},
                           "Megatron resuming the converted checkpoint")

    back_dir = tmp_path / "back"  # Megatron-LM's own iteration 4 (dp_reshardable), converted to ours
    assert convert(str(native_dir), str(back_dir), "--to", "datastates", "--iteration", "4")["optimizer_format"] == \
        "dp_reshardable"
    back = run(checkout, 2, [*common, "--save", str(back_dir), "--load", str(back_dir), *DATASTATES], tmp_path,
               "back_resume")
    assert_same_trajectory(trajectory(back), {k: v for k, v in trajectory(reference).items() if k > 4},
                           "--use-datastates resuming Megatron's checkpoint converted to ours")


@pytest.mark.parametrize("variant", [["--dist-ckpt-optim-fully-reshardable"],
                                     ["--dist-ckpt-optim-fully-reshardable",
                                      "--distrib-optim-fully-reshardable-mem-efficient"]],
                         ids=["fully_reshardable", "fully_reshardable_mem_efficient"])
def test_megatron_fully_reshardable_converts_both_ways(checkout, tmp_path, variant):
    """Megatron-LM's own ``fully_reshardable`` saves (both variants): converted to ours, resumed with
    ``--use-datastates`` bit-exactly against Megatron-LM's native resume, and also at another data-parallel
    size (the format reshards); converted back, Megatron-LM resumes it natively."""
    common = [*BF16_DIST, *ITERS, "--save-interval", "1"]
    native = run_scenario(checkout, 2, [Phase(["--exit-interval", "3", *variant])], tmp_path / "native", NATIVE, common)
    reference = run(checkout, 2, [*common, "--save", str(copy_checkpoints(native.save_dir, tmp_path / "ref")),
                                  "--load", str(tmp_path / "ref"), *NATIVE, *variant], tmp_path, "native_resume")
    ours = tmp_path / "ours"
    summary = _convert(str(native.save_dir), str(ours), "--to", "datastates")
    assert summary["optimizer_format"] == "fully_reshardable" and summary["iteration"] == 3
    resumed = run(checkout, 2, [*common, "--save", str(ours), "--load", str(ours), *DATASTATES], tmp_path,
                  "datastates_resume")
    assert_same_trajectory(trajectory(resumed), {k: v for k, v in trajectory(reference).items() if k > 3},
                           "Megatron-LM's fully_reshardable converted to ours vs Megatron-LM's own resume")
    wider = tmp_path / "wider"  # the converted optimizer is reshardable: DP 2 -> DP 4 loads
    copy_checkpoints(ours, wider)
    for it in (4, 5, 6):  # back to the converted iteration 3
        shutil.rmtree(wider / f"iter_{it:07d}", ignore_errors=True)
    (wider / "latest_checkpointed_iteration.txt").write_text("3")
    four = run(checkout, 4, [*common, "--save", str(wider), "--load", str(wider), *DATASTATES, "--exit-interval", "4"],
               tmp_path, "datastates_dp4")
    assert "resharding iter_0000003" in four.log and [r["iteration"] for r in four.records] == [4]
    back = tmp_path / "back"
    assert _convert(str(ours), str(back), "--to", "torch_dist", "--iteration", "3")["optimizer_format"] == \
        "fully_reshardable"
    again = run(checkout, 2, [*common, "--save", str(back), "--load", str(back), *NATIVE, *variant], tmp_path,
                "native_again")
    assert_same_trajectory(trajectory(again), {k: v for k, v in trajectory(reference).items() if k > 3},
                           "ours converted back to fully_reshardable, resumed by Megatron-LM")


def test_llama_style_reshard_tp2_pp2_to_tp1_pp2_dp2(checkout, tmp_path):
    """A Llama-style checkpoint (SwiGLU halves, GQA, untied) saved at TP2 x PP2 x DP1, resumed at TP1 x PP2 x DP2:
    bit-identical to Megatron-LM's own reshard of its fully_reshardable checkpoint."""
    common = [*BF16_DIST, *ITERS, "--save-interval", "1", *LLAMA_STYLE, "--pipeline-model-parallel-size", "2"]
    _reshard_against_torch_dist(checkout, tmp_path, common, ["--tensor-model-parallel-size", "2"],
                                "Llama-style TP2 x PP2 -> TP1 x PP2 x DP2")


def test_lion_reshard_tp2_to_tp1_dp2(checkout, tmp_path):
    """A Llama-style ``--optimizer lion`` checkpoint saved at TP2 x DP1, resumed at TP1 x DP2: ours against
    Megatron-LM's own torch_dist doing the same, bit for bit.

    Lion's state is megatron-core's per-parameter one (not the distributed optimizer's), which
    torch_dist reshards across TP and DP itself, so it is the oracle here. Also: the optimizer state
    both saved is identical, tensor by tensor (Lion's exp_avg and main params of a linear weight, the
    chained Adam's of the output layer), Lion's parameters have no exp_avg_sq, and an Adam run
    loading the Lion checkpoint is refused naming both optimizers.
    """
    common = [*LION, *ITERS, "--save-interval", "1", *LLAMA_STYLE]
    results = {}
    for side, flags in {"datastates": DATASTATES, "torch_dist": NATIVE}.items():
        save = tmp_path / side / "ckpt"
        args = [*common, "--save", str(save), "--load", str(save), *flags]
        before = run(checkout, 2, [*args, "--tensor-model-parallel-size", "2", "--exit-interval", "3"],
                     tmp_path / side, "tp2")
        after = run(checkout, 2, args, tmp_path / side, "tp1_dp2")
        results[side] = (before, after)
    ours, theirs = results["datastates"], results["torch_dist"]
    assert "resharding iter_0000003" in ours[1].log
    assert [r["iteration"] for r in ours[1].records] == [4, 5, 6]
    assert_same_trajectory(trajectory(*ours), trajectory(*theirs), "Lion TP2 -> TP1 x DP2: datastates vs torch_dist")

    ours_dir, theirs_dir = tmp_path / "datastates" / "ckpt", tmp_path / "torch_dist" / "ckpt"
    keys = {"decoder.layers.mlp.linear_fc1.weight": "chained_0", "output_layer.weight": "chained_1"}  # Lion, Adam
    for iteration in (3, 6):  # saved at TP2, and after the resharded resume
        for key, chained in keys.items():
            for moment in ("fp32_param", "exp_avg"):
                mine = saved_tensor(ours_dir, iteration, f"{chained}.optimizer.state.{moment}.{key}", True)
                native = saved_tensor(theirs_dir, iteration, f"optimizer.state.{moment}.{key}", False)
                assert torch.equal(mine, native), f"iteration {iteration}: {moment} of {key} differs from torch_dist's"
    saved_keys = _all_keys(ours_dir, 3)
    assert "chained_1.optimizer.state.exp_avg_sq.output_layer.weight" in saved_keys
    assert not [k for k in saved_keys if k.startswith("chained_0.") and ".exp_avg_sq." in k]

    refused = run(checkout, 2, [*common, "--optimizer", "adam", "--save", str(ours_dir), "--load", str(ours_dir),
                                *DATASTATES], tmp_path, "adam_loads_lion", expect_failure=True)
    assert "saved by Lion (moments: exp_avg) + AdamW (moments: exp_avg, exp_avg_sq), but this run's optimizer " \
           "is AdamW (moments: exp_avg, exp_avg_sq)" in refused.log, refused.log[-3000:]
    assert not refused.records


def _all_keys(save_dir, iteration: int) -> set[str]:
    """Every global tensor key of one of our checkpoints."""
    from megatron_ext.megatron.export import open_iteration
    from megatron_ext.megatron.shard_assembly import SavedShards

    return set(SavedShards(open_iteration(str(save_dir), iteration)).keys())


def test_gpt_checkpoint_converted_to_torch_dist_loads_into_a_hybrid_model(checkout, tmp_path):
    """The way out the refusal names (docs/MEGATRON.md, "What core_v0.19.0 added"): a GPT checkpoint of ours,
    converted to torch_dist, is loaded by Megatron-LM's own loader into ``pretrain_hybrid.py``'s HybridModel
    (its GPT -> hybrid translation), under ``--use-datastates``, and training goes on from it."""
    common = [*BF16_DIST, "--save-interval", "1"]
    gpt = run_scenario(checkout, 2, [Phase(["--train-iters", "2"])], tmp_path / "gpt", DATASTATES, common)
    converted = tmp_path / "torch_dist"
    _convert(str(gpt.save_dir), str(converted), "--to", "torch_dist")
    layers = int(TINY_GPT[TINY_GPT.index("--num-layers") + 1])  # each GPT layer: an attention and an MLP layer
    hybrid_model = [*without_flags(TINY_GPT, "--num-layers"), "--spec", "megatron_ext.testing.hybrid_local_spec",
                    "hybrid_local_stack_spec", "--hybrid-layer-pattern", "*-" * layers]
    hybrid = run(checkout, 2, [*common, *DATASTATES, "--save", str(tmp_path / "hybrid"), "--load", str(converted),
                               "--train-iters", "4", "--override-opt_param-scheduler"], tmp_path, "hybrid",
                 model=hybrid_model, script="pretrain_hybrid.py")
    assert "loading a GPT checkpoint into the hybrid model" in hybrid.log
    assert [r["iteration"] for r in hybrid.records] == [3, 4]
    assert read_tracker(tmp_path / "hybrid") == "4"
