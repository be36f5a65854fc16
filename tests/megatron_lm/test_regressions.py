"""What Megatron-LM's own loop does around checkpoints, on 2 CPU ranks: ours against Megatron's torch_dist.

Each test starts from a checkpoint of the same 3 iterations written by each side (``base``: a
6-iteration job stopped by ``--exit-interval 3``) and runs the same scenario on both; the per-iteration trajectories must be bit-identical. The
scenarios are the gaps found when running ``pretrain_gpt.py --use-datastates`` for real:
fine-tuning and ``--no-load-optim`` (the fp32 main params must follow the loaded weights),
``--pretrained-checkpoint``, a batch-size ramp-up (one iteration saved twice, the micro-batch
count restored at load), ``--use-checkpoint-args``, ``--ckpt-convert-format`` and a resume from a
checkpoint in Megatron-LM's own format, and the argument checks against the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.megatron_lm_runs import (DATASTATES, NATIVE, Phase, assert_same_trajectory, copy_checkpoints,
                                      read_tracker, run, run_scenario, trajectory)
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
    """--rampup-batch-size: Megatron saves iteration 4 again when the batch grows; a resume restores the micro-batches.

    The global batch is 4 samples for 16 samples (iterations 1-4), then 8 (iterations 5-8);
    ramp-up needs sample-based training.
    """
    model = _without(TINY_GPT, "--lr-warmup-iters", "--lr-decay-iters")
    common = [*COMMON, "--rampup-batch-size", "4", "4", "16", "--train-samples", "48", "--lr-warmup-samples", "8",
              "--lr-decay-samples", "96"]
    phases = [Phase([], kill_at=6, committed_before_kill=4), Phase([])]
    ours = run_scenario(checkout, 2, phases, tmp_path / "datastates", DATASTATES, common, model=model)
    theirs = run_scenario(checkout, 2, phases, tmp_path / "torch_dist", NATIVE, common, model=model)
    assert "iter_0000004 is saved again" in ours.runs[0].log
    assert ours.runs[1].first_iteration > 4  # resumed after the ramp-up: the micro-batch count comes from the load
    assert_same_trajectory(ours.trajectory, theirs.trajectory, "batch-size ramp-up: datastates vs torch_dist")
    assert list(ours.trajectory) == list(range(1, 9))


def _without(flags: list[str], *names: str) -> list[str]:
    """``flags`` without the named options and their values."""
    return [a for i, a in enumerate(flags) if a not in names and (i == 0 or flags[i - 1] not in names)]


def test_use_checkpoint_args_reads_the_model_shape_from_the_checkpoint(checkout, base, tmp_path):
    without = _without(TINY_GPT, "--num-layers", "--hidden-size", "--num-attention-heads")

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
