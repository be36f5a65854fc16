"""What Megatron-LM's own loop does around checkpoints, on 2 CPU ranks: ours against Megatron's torch_dist.

Each test starts from a checkpoint of the same 3 iterations written by each side (``base``: a
6-iteration job stopped by ``--exit-interval 3``) and runs the same scenario on both; the per-iteration trajectories must be bit-identical. The
scenarios are the gaps found when running ``pretrain_gpt.py --use-datastates`` for real:
fine-tuning and ``--no-load-optim`` (the fp32 main params must follow the loaded weights),
``--pretrained-checkpoint``, a batch-size ramp-up (one iteration saved twice, the micro-batch
count restored at load), ``--use-checkpoint-args``, ``--ckpt-convert-format`` and a resume from a
checkpoint in Megatron-LM's own format, and the argument checks against the checkpoint. Since
core_v0.19.0: ``--override-ckpt-iteration`` (from a checkpoint of 4 iterations, ``saved_through_4``)
and the refusal of a GPT checkpoint by ``pretrain_hybrid.py`` (and the reverse).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.megatron_lm_runs import (DATASTATES, NATIVE, Phase, assert_same_trajectory, copy_checkpoints,
                                      read_tracker, run, run_scenario, trajectory, without_flags)
from megatron_ext.testing.megatron_lm import TINY_GPT

BASE_ITERS = 3
TRAIN_ITERS = ["--train-iters", "6"]  # the job's length, the same for every run (the scheduler checks it)
COMMON = ["--bf16", "--use-distributed-optimizer", "--save-interval", "1"]
SIDES = {"datastates": DATASTATES, "torch_dist": NATIVE}


@pytest.fixture(scope="module")
def base(checkout, tmp_path_factory) -> dict[str, Path]:
    """3 iterations checkpointed every iteration, by each side; tests work on copies."""
    out = {}
    for side, flags in SIDES.items():
        work = tmp_path_factory.mktemp(f"base_{side}")
        result = run_scenario(checkout, 2, [Phase([*TRAIN_ITERS, "--exit-interval", str(BASE_ITERS)])], work, flags,
                              COMMON)
        assert result.runs[0].records[-1]["iteration"] == BASE_ITERS
        assert result.trackers[-1] == str(BASE_ITERS)
        out[side] = result.save_dir
    return out


def _from_base(checkout, base, tmp_path, args: list[str], side: str, name: str = "resume"):
    save = copy_checkpoints(base[side], tmp_path / side / "ckpt")
    return run(checkout, 2, [*COMMON, "--save", str(save), "--load", str(save), *SIDES[side], *args],
               tmp_path / side, name)


@pytest.mark.parametrize("flags", [["--no-load-optim"], ["--finetune"]], ids=["no_load_optim", "finetune"])
def test_weights_only_load_keeps_the_loaded_weights(checkout, base, tmp_path, flags):
    """No optimizer state loaded: the fp32 main params start from the loaded weights (Megatron reloads them)."""
    ours = _from_base(checkout, base, tmp_path, [*flags, *TRAIN_ITERS], "datastates")
    theirs = _from_base(checkout, base, tmp_path, [*flags, *TRAIN_ITERS], "torch_dist")
    first = ours.records[0]["iteration"]
    assert first == (1 if flags == ["--finetune"] else BASE_ITERS + 1)
    assert_same_trajectory(trajectory(ours), trajectory(theirs), f"{flags[0]}: datastates vs torch_dist")


def test_pretrained_checkpoint_fine_tunes_from_it(checkout, base, tmp_path):
    """An empty --load and --pretrained-checkpoint: fine-tune (iteration 0, no optimizer) from it."""
    def finetune(side: str, pretrained_side: str, name: str):
        save = tmp_path / name / "ckpt"
        return run(checkout, 2, [*COMMON, "--save", str(save), "--load", str(save), "--pretrained-checkpoint",
                                 str(base[pretrained_side]), *TRAIN_ITERS, *SIDES[side]], tmp_path / name, name)

    ours = finetune("datastates", "datastates", "ours")
    theirs = finetune("torch_dist", "torch_dist", "theirs")
    # A user of --use-datastates fine-tuning from a checkpoint Megatron-LM wrote itself.
    mixed = finetune("datastates", "torch_dist", "mixed")
    assert ours.records[0]["iteration"] == 1
    assert_same_trajectory(trajectory(ours), trajectory(theirs), "fine-tuning: datastates vs torch_dist")
    assert_same_trajectory(trajectory(mixed), trajectory(theirs), "fine-tuning from torch_dist with --use-datastates")
    assert read_tracker(tmp_path / "ours" / "ckpt") == "6"


def test_batch_size_rampup_saves_an_iteration_twice_and_resumes(checkout, tmp_path):
    """A batch-size schedule: Megatron saves iteration 4 again when the batch grows; a resume restores the micro-batches.

    The global batch is 4 samples for the first 1024 tokens (16 samples of 64 tokens: iterations
    1-4), then 8 (iterations 5-8). Since core_v0.19.0 that is ``--step-batch-size-schedule``
    (``--rampup-batch-size`` is still parsed but ignored), with no ``--global-batch-size``; it needs
    sample-based training.
    """
    model = without_flags(TINY_GPT, "--lr-warmup-iters", "--lr-decay-iters", "--global-batch-size")
    common = [*COMMON, "--step-batch-size-schedule", "0:4 1024:8", "--train-samples", "48", "--lr-warmup-samples", "8",
              "--lr-decay-samples", "96"]
    phases = [Phase([], kill_at=6, committed_before_kill=4), Phase([])]
    ours = run_scenario(checkout, 2, phases, tmp_path / "datastates", DATASTATES, common, model=model)
    theirs = run_scenario(checkout, 2, phases, tmp_path / "torch_dist", NATIVE, common, model=model)
    # Saved again in the same run: the second attempt's manifest replaced the first (docs/FORMAT.md).
    # (Read from the checkpoint, not the INFO log: importing emerging-optimizers, through absl, sets the
    # root logger up at WARNING before Megatron-LM's own INFO default can.)
    manifest = json.loads((tmp_path / "datastates" / "ckpt" / "iter_0000004" / "manifest.json").read_text())
    assert manifest.get("attempt_of"), manifest.get("run_id")
    assert ours.runs[1].first_iteration > 4  # resumed after the ramp-up: the micro-batch count comes from the load
    assert_same_trajectory(ours.trajectory, theirs.trajectory, "batch-size ramp-up: datastates vs torch_dist")
    assert list(ours.trajectory) == list(range(1, 9))


def test_use_checkpoint_args_reads_the_model_shape_from_the_checkpoint(checkout, base, tmp_path):
    without = without_flags(TINY_GPT, "--num-layers", "--hidden-size", "--num-attention-heads")

    def resume(side: str):
        save = copy_checkpoints(base[side], tmp_path / side / "ckpt")
        return run(checkout, 2, [*COMMON, "--save", str(save), "--load", str(save), "--use-checkpoint-args",
                                 *TRAIN_ITERS, *SIDES[side]], tmp_path / side, "resume",
                   model=without)

    ours, theirs = resume("datastates"), resume("torch_dist")
    assert "Setting num_layers to 4 from checkpoint" in ours.log
    assert_same_trajectory(trajectory(ours), trajectory(theirs), "--use-checkpoint-args: datastates vs torch_dist")


def test_convert_format_and_resume_from_megatron_format(checkout, base, tmp_path):
    """--ckpt-convert-format writes Megatron's format from ours; --use-datastates resumes from Megatron's format."""
    iters = TRAIN_ITERS
    theirs = _from_base(checkout, base, tmp_path, iters, "torch_dist")  # the oracle: Megatron resuming its own

    converted = tmp_path / "converted"
    source = copy_checkpoints(base["datastates"], tmp_path / "source")
    run(checkout, 2, [*COMMON, "--load", str(source), "--save", str(source), *DATASTATES, *iters,
                      "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", str(converted)],
        tmp_path, "convert")
    assert read_tracker(converted / "torch_dist") == str(BASE_ITERS)
    native_from_ours = run(checkout, 2, [*COMMON, "--load", str(converted / "torch_dist"), "--save",
                                         str(converted / "torch_dist"), *NATIVE, *iters], tmp_path, "native_resume")
    assert_same_trajectory(trajectory(native_from_ours), trajectory(theirs),
                           "Megatron resuming the converted checkpoint vs its own")

    mixed = copy_checkpoints(base["torch_dist"], tmp_path / "mixed")
    ours_from_native = run(checkout, 2, [*COMMON, *DATASTATES, *iters, "--load", str(mixed), "--save", str(mixed)],
                           tmp_path, "datastates_from_native")
    assert "holds a checkpoint in Megatron-LM's own format" in ours_from_native.log
    assert_same_trajectory(trajectory(ours_from_native), trajectory(theirs),
                           "--use-datastates resuming a torch_dist checkpoint vs Megatron")
    assert read_tracker(mixed) == "6"


def test_checkpoint_args_are_checked(checkout, base, tmp_path):
    """A model shape other than the checkpoint's fails with Megatron-LM's own message, before any weight is read."""
    save = copy_checkpoints(base["datastates"], tmp_path / "ckpt")
    wider = [a if TINY_GPT[i - 1] != "--hidden-size" else "128" for i, a in enumerate(TINY_GPT)]
    result = run(checkout, 2, [*COMMON, *DATASTATES, "--save", str(save), "--load", str(save), *TRAIN_ITERS],
                 tmp_path, "wider", expect_failure=True, model=wider)
    assert "hidden_size value from checkpoint (64) is not equal to the input argument value (128)" in result.log


# ---------------------------------------------------------------------------- --override-ckpt-iteration
OVERRIDE_SAVED, OVERRIDE_TO = 4, 2


@pytest.fixture(scope="module")
def saved_through_4(checkout, tmp_path_factory) -> dict[str, Path]:
    """Each side's checkpoints of iterations 1-4 (a 6-iteration job stopped by ``--exit-interval 4``)."""
    out = {}
    for side, flags in SIDES.items():
        work = tmp_path_factory.mktemp(f"through4_{side}")
        result = run_scenario(checkout, 2, [Phase([*TRAIN_ITERS, "--exit-interval", str(OVERRIDE_SAVED)])], work,
                              flags, COMMON)
        assert result.trackers[-1] == str(OVERRIDE_SAVED)
        out[side] = result.save_dir
    return out


def test_override_ckpt_iteration_rewinds_the_run_as_megatron_does(checkout, saved_through_4, tmp_path):
    """--override-ckpt-iteration 2 on a checkpoint of iteration 4: the weights and optimizer of iteration 4,
    the run resumed at iteration 3 with the data loader at 2 global batches; bit-identical to torch_dist's."""
    resumed = {}
    for side in SIDES:
        save = copy_checkpoints(saved_through_4[side], tmp_path / side / "ckpt")
        resumed[side] = run(checkout, 2, [*COMMON, "--save", str(save), "--load", str(save), *SIDES[side],
                                          *TRAIN_ITERS, "--override-ckpt-iteration", str(OVERRIDE_TO)],
                            tmp_path / side, "override")
    ours, theirs = resumed["datastates"], resumed["torch_dist"]
    assert ours.first_iteration == OVERRIDE_TO + 1
    # Recorded before the loop counts the step's batch: the data loader starts at 2 global batches of 8.
    assert ours.records[0]["consumed_train_samples"] == OVERRIDE_TO * 8
    assert "overriding the checkpoint's iteration to 2 (consumed_train_samples = 16)" in ours.log
    assert_same_trajectory(trajectory(ours), trajectory(theirs), "--override-ckpt-iteration: datastates vs torch_dist")


# ---------------------------------------------------------------------------- GPT <-> HybridModel
def test_gpt_and_hybrid_checkpoints_are_refused_by_name(checkout, saved_through_4, tmp_path):
    """pretrain_hybrid.py (a HybridModel of attention and MLP layers, local modules) loading a GPT checkpoint
    of ours, and pretrain_gpt.py loading a HybridModel checkpoint of ours: each refused, naming the two kinds,
    before any shard is read (Megatron-LM translates GPT checkpoints into a HybridModel for its own formats only)."""
    hybrid_model = [*without_flags(TINY_GPT, "--num-layers"), "--spec", "megatron_ext.testing.hybrid_local_spec",
                    "hybrid_local_stack_spec", "--hybrid-layer-pattern", "*-*-"]
    gpt = copy_checkpoints(saved_through_4["datastates"], tmp_path / "gpt")
    into_hybrid = run(checkout, 2, [*COMMON, *DATASTATES, "--save", str(gpt), "--load", str(gpt), *TRAIN_ITERS],
                      tmp_path, "gpt_into_hybrid", expect_failure=True, model=hybrid_model,
                      script="pretrain_hybrid.py")
    assert ("cannot load into this model: it was saved from a GPT model and this run builds a HybridModel"
            in into_hybrid.log)

    hybrid = tmp_path / "hybrid"
    saved = run(checkout, 2, [*COMMON, *DATASTATES, "--save", str(hybrid), "--load", str(hybrid), *TRAIN_ITERS,
                              "--exit-interval", "1"], tmp_path, "hybrid", model=hybrid_model,
                script="pretrain_hybrid.py")
    assert saved.records[-1]["iteration"] == 1 and read_tracker(hybrid) == "1"
    into_gpt = run(checkout, 2, [*COMMON, *DATASTATES, "--save", str(hybrid), "--load", str(hybrid), *TRAIN_ITERS],
                   tmp_path, "hybrid_into_gpt", expect_failure=True)
    assert ("cannot load into this model: it was saved from a HybridModel and this run builds a GPT model"
            in into_gpt.log)
