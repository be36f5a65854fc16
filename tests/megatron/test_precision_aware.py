"""``--use-precision-aware-optimizer``: the stored form is saved as it is, recorded, and checked at load.

Transformer Engine's FusedAdam cannot run here; ``megatron_ext.testing.te_fused_adam`` stands in
for it (the interface and storage megatron-core uses, from TE 2.9-2.11). The end-to-end test runs
megatron-core's real ``DistributedOptimizer`` in its precision-aware mode around it on two CPU
ranks (``precision_aware_worker.py``); the others check the pieces on their own.
"""

import argparse
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.procs import torchrun_command
from helpers.trainer_runs import REPO, trainer_env

pytest.importorskip("megatron.core")

from megatron_ext.engine import CheckpointError  # noqa: E402
from megatron_ext.megatron import optimizer_forms, optimizer_state  # noqa: E402
from megatron_ext.megatron.args import validate_datastates_args  # noqa: E402
from megatron_ext.testing.te_fused_adam import FusedAdam, _join_remainder, _split_remainder  # noqa: E402


@pytest.mark.multiproc
def test_precision_aware_optimizer_saves_its_stored_form_and_resumes_exactly(tmp_path):
    cmd = torchrun_command(2, str(Path(__file__).parent / "precision_aware_worker.py"), str(tmp_path),
                           "remainders", "fp16")
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    oks = [line for line in proc.stdout.splitlines() if line.startswith("ok: ")]
    assert len(oks) == 2 * 4 + 1, proc.stdout
    assert "main_param_remainders" in proc.stdout and "exp_avg_fp16_scale" in proc.stdout


def _optimizer(**kwargs) -> tuple[SimpleNamespace, torch.Tensor]:
    """A distributed optimizer's view of one bf16 parameter slice, around the FusedAdam stand-in."""
    param = torch.randn(8).bfloat16()
    inner = FusedAdam([param], lr=1e-2, master_weights=True, use_decoupled_grad=True, **kwargs)
    config = SimpleNamespace(use_precision_aware_optimizer=True, use_precision_aware_optimizer_no_fp8_or_ds_fp8=True,
                             bf16=True)
    opt = SimpleNamespace(optimizer=inner, config=config, model_param_group_index_map={"p": (0, 0)})
    param.decoupled_grad = torch.randn(8)
    inner.step()
    return opt, param


def test_stored_tensors_are_the_optimizers_own_no_copy():
    opt, param = _optimizer(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16,
                            store_param_remainders=True)
    before = opt.optimizer.unscaled_copies
    slices, scales = optimizer_state.stored_tensors(opt, "p")
    state = opt.optimizer.state[param]
    assert slices["main_param_remainders"] is state["master_param"] and state["master_param"].dtype == torch.int16
    assert slices["exp_avg_bf16"] is state["exp_avg"] and slices["exp_avg_sq_fp16"] is state["exp_avg_sq"]
    assert scales == {"exp_avg_sq_fp16": opt.optimizer._scales[param]["exp_avg_sq"]}
    assert opt.optimizer.unscaled_copies == before  # reading the stored form makes no fp32 copy
    assert optimizer_forms.stored_form(opt) == {"optimizer": "FusedAdam", "moments": ["exp_avg", "exp_avg_sq"],
                                                "main_params": optimizer_forms.REMAINDERS, "exp_avg": "bf16",
                                                "exp_avg_sq": "fp16", "precision_aware_optimizer": True}


def test_common_state_does_not_ask_fused_adam_for_unscaled_copies():
    opt, _ = _optimizer(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=True)
    seen = {}

    def state_dict():
        seen["inner"] = opt.optimizer.state_dict()
        return {"optimizer": {"param_groups": seen["inner"]["param_groups"]}}

    opt.state_dict = state_dict
    before = opt.optimizer.unscaled_copies
    optimizer_state._common_state(opt)
    assert opt.optimizer.unscaled_copies == before
    assert "state_dict" not in vars(opt.optimizer)  # torch's own again after the block
    opt.optimizer.state_dict()
    assert opt.optimizer.unscaled_copies > before


def test_remainders_round_trip_bits():
    main = torch.randn(100000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 100000)
    main[:4] = torch.tensor([1.0 + 2 ** -8, -(1.0 + 2 ** -8), 1.0 + 3 * 2 ** -8, 0.0])  # ties, and zero
    param, remainder = _split_remainder(main)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(_join_remainder(param, remainder).view(torch.int32), main.view(torch.int32))
    # The high half rounded to nearest (as torch's cast), ties away from zero (TE's kernel) where torch's go to even.
    assert torch.equal((param.float() - main).abs(), (main.bfloat16().float() - main).abs())
    assert param[:4].tolist() == [1.0078125, -1.0078125, 1.015625, 0.0]


def _form(main="fp32", avg="fp32", sq="fp32", aware=False) -> dict:
    return {"main_params": main, "exp_avg": avg, "exp_avg_sq": sq, "precision_aware_optimizer": aware}


class _Opt(SimpleNamespace):
    pass


def _check(saved, now: dict, resharding=False):
    opt = _Opt(gbuf_ranges=[], _get_main_param_and_optimizer_states=None)
    saved_common = {"param_state_sharding_type": optimizer_forms.MODEL_SPACE}
    if saved is not None:
        saved_common[optimizer_forms.STORED_FORM] = saved
    real = optimizer_forms.stored_form
    optimizer_forms.stored_form = lambda _: now
    try:
        optimizer_forms.check_stored_form(opt, saved_common, checkpoint="iter_0000005", resharding=resharding)
    finally:
        optimizer_forms.stored_form = real


def test_another_stored_form_is_refused_naming_both_and_the_flags():
    remainders = _form(optimizer_forms.REMAINDERS, "bf16", "bf16", True)
    _check(remainders, remainders)
    _check(remainders, remainders, resharding=True)  # elementwise: reshards exactly
    _check(None, _form())  # saved before the record: the plain form
    with pytest.raises(CheckpointError) as info:
        _check(remainders, _form())
    text = str(info.value)
    assert "iter_0000005" in text and "saved main params bf16 + int16 remainders, exp_avg bf16" in text
    assert "now main params fp32, exp_avg fp32, exp_avg_sq fp32" in text
    assert "--use-precision-aware-optimizer --main-params-dtype fp32 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" in text
    assert "without --use-precision-aware-optimizer" in text and "--no-load-optim" in text
    with pytest.raises(CheckpointError, match="saved before megatron_ext recorded the form"):
        _check(None, remainders)
    with pytest.raises(CheckpointError, match="--exp-avg-sq-dtype fp16"):
        _check(_form("fp16", "fp16", "fp16", True), remainders)


def test_a_scaled_form_is_refused_on_another_layout():
    fp16 = _form("fp16", "bf16", "fp16", True)
    _check(fp16, fp16)
    with pytest.raises(CheckpointError, match="main_params, exp_avg_sq in fp16 divided by a scale"):
        _check(fp16, fp16, resharding=True)


def test_fp8_moments_are_refused_at_start_up_and_at_save(tmp_path):
    args = argparse.Namespace(use_datastates=True, save=str(tmp_path), use_precision_aware_optimizer=True,
                              exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16")
    with pytest.raises(ValueError, match="--exp-avg-dtype fp8"):
        validate_datastates_args(args)
    args.exp_avg_dtype = "bf16"
    validate_datastates_args(args)
    opt, param = _optimizer(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    opt.optimizer.name_to_dtype_map["exp_avg"] = torch.uint8  # as TE's FusedAdam with --exp-avg-dtype fp8
    with pytest.raises(CheckpointError, match="cannot save fp8 optimizer state"):
        optimizer_state.stored_tensors(opt, "p")
    with pytest.raises(CheckpointError, match="exp_avg"):
        optimizer_forms.refuse_fp8(optimizer_forms.stored_form(opt))
