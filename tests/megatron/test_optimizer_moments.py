"""Optimizers keep different moments: the stored form records each one's class and moment set, and a
load into optimizers that keep other moments (a Lion checkpoint into an Adam run, or the reverse)
is refused before anything is read, naming both.

``--optimizer lion`` (core_v0.19.0, ``emerging-optimizers``) is a ``ChainedOptimizer`` of two
non-distributed optimizers: Lion (``exp_avg`` only) for the linear weights, Adam for the rest.
Their state is megatron-core's own per-parameter sharded state; before the moment set was recorded
nothing in it said which optimizer saved it, nothing was compared at the load, and a Lion checkpoint
loaded into an Adam run (or the reverse) got as far as reading shards, to fail on a missing one
naming neither optimizer. The runs in Megatron-LM's loop are the matrix's ``lion`` scenario and
``test_lion_reshard_tp2_to_tp1_dp2`` (``tests/megatron_lm/test_matrix.py``, slow).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.trainer_runs import REPO, trainer_env  # noqa: E402
from megatron_ext.engine import CheckpointError  # noqa: E402
from megatron_ext.megatron import optimizer_forms, optimizer_state  # noqa: E402


def _lion(params):
    lion = pytest.importorskip("emerging_optimizers.scalar_optimizers")
    return lion.Lion(params, lr=1e-3)


class _Chain(SimpleNamespace):
    """What the adapter reads of a megatron-core ``ChainedOptimizer`` of non-distributed optimizers."""

    def sharded_state_dict(self, model_sharded, is_loading=False):
        # megatron-core's shape: one optimizer's state itself, several as {index: state}
        parts = [{"optimizer": {"param_groups": []}} for _ in self.chained_optimizers]
        return parts[0] if len(parts) == 1 else dict(enumerate(parts))


def _wrapped(inner) -> SimpleNamespace:
    """A non-distributed megatron-core optimizer (``Float16OptimizerWithFloat16Params``) around ``inner``."""
    return SimpleNamespace(optimizer=inner, config=SimpleNamespace(bf16=True, use_precision_aware_optimizer=False))


def _lion_run() -> _Chain:
    """``--optimizer lion``: Lion for the linear weights, AdamW for the others (megatron-core's default overrides)."""
    return _Chain(chained_optimizers=[_wrapped(_lion([torch.zeros(4, 4)])),
                                      _wrapped(torch.optim.AdamW([torch.zeros(4)]))])


def _adam_run(n: int = 1) -> _Chain:
    return _Chain(chained_optimizers=[_wrapped(torch.optim.AdamW([torch.zeros(4)])) for _ in range(n)])


def _saved_common(run: _Chain) -> dict:
    """The common ``optimizer`` state the save writes for ``run`` (its non-tensor part)."""
    return optimizer_state.model_space_state_dict(run, {})


def _check(run: _Chain, saved_common: dict) -> None:
    optimizer_forms.check_stored_form(run, saved_common, checkpoint="iter_0000003", resharding=False)


@pytest.mark.parametrize("make, expected", [
    (lambda p: _lion(p), ("exp_avg",)),
    (lambda p: torch.optim.Adam(p), ("exp_avg", "exp_avg_sq")),
    (lambda p: torch.optim.AdamW(p), ("exp_avg", "exp_avg_sq")),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ("momentum_buffer",)),
    (lambda p: torch.optim.SGD(p, lr=0.1), ()),
], ids=["lion", "adam", "adamw", "adamw_amsgrad", "sgd_momentum", "sgd"])
def test_the_moment_set_is_what_the_optimizer_keeps_before_and_after_its_first_step(make, expected):
    param = torch.nn.Parameter(torch.randn(3, 2))
    inner = make([param])
    opt = _wrapped(inner)
    assert optimizer_forms.moments(opt) == tuple(sorted(expected))  # a fresh optimizer (a load's): by its class
    param.grad = torch.randn_like(param)
    with torch.compiler.set_stance("force_eager"):  # Lion's update is torch.compile'd; eager keeps this test cheap
        inner.step()
    live = {k for k, v in inner.state[param].items() if k != "step" and isinstance(v, torch.Tensor)}
    assert live == set(expected)
    form = optimizer_forms.stored_form(opt)
    assert form["moments"] == sorted(expected) and all(form[m] == "fp32" for m in expected)
    assert ("exp_avg_sq" in form) == ("exp_avg_sq" in expected)  # kinds of the moments it keeps, only


def test_each_chained_optimizer_records_its_own_form():
    common = _saved_common(_lion_run())
    forms = [common[i][optimizer_forms.STORED_FORM] for i in (0, 1)]
    assert forms[0] == {"optimizer": "Lion", "moments": ["exp_avg"], "main_params": "fp32", "exp_avg": "fp32",
                        "precision_aware_optimizer": False}
    assert forms[1]["optimizer"] == "AdamW" and forms[1]["moments"] == ["exp_avg", "exp_avg_sq"]
    single = _saved_common(_adam_run())
    assert single[optimizer_forms.STORED_FORM]["moments"] == ["exp_avg", "exp_avg_sq"]


def test_a_lion_checkpoint_and_an_adam_run_refuse_each_other_naming_both():
    lion, adam = _saved_common(_lion_run()), _saved_common(_adam_run())
    _check(_lion_run(), lion)
    _check(_adam_run(), adam)
    with pytest.raises(CheckpointError) as info:
        _check(_adam_run(), lion)
    text = str(info.value)
    assert "iter_0000003" in text
    assert "saved by Lion (moments: exp_avg) + AdamW (moments: exp_avg, exp_avg_sq)" in text
    assert "this run's optimizer is AdamW (moments: exp_avg, exp_avg_sq)" in text
    assert "--optimizer lion" in text and "--no-load-optim" in text
    with pytest.raises(CheckpointError) as info:
        _check(_lion_run(), adam)
    text = str(info.value)
    assert "saved by AdamW (moments: exp_avg, exp_avg_sq)" in text and "this run's optimizer is Lion" in text
    assert "--optimizer adam" in text
    # As many chained optimizers, one of them Lion where Adam was saved (an MoE Adam run has two):
    with pytest.raises(CheckpointError, match=r"saved by AdamW .* \+ AdamW .*this run's optimizer is Lion"):
        _check(_lion_run(), _saved_common(_adam_run(2)))


def test_a_checkpoint_without_the_record_is_not_compared_by_moments():
    unrecorded = _saved_common(_lion_run())
    for part in unrecorded.values():
        del part[optimizer_forms.STORED_FORM]
    _check(_lion_run(), unrecorded)  # as before the record: nothing to compare
    with pytest.raises(CheckpointError, match="moments not recorded"):  # another number of optimizers: never loads
        _check(_adam_run(), unrecorded)


REAL = """
import copy
import torch
from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
enable_cpu_emulation()
from emerging_optimizers.scalar_optimizers import Lion
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params
from megatron_ext.engine import CheckpointError
from megatron_ext.megatron import optimizer_forms, optimizer_load, optimizer_state

torch.manual_seed(0)
config = OptimizerConfig(optimizer="lion", lr=1e-3, bf16=True)


def lion_init(opt, config=None):  # megatron-core's init_state_fn of emerging optimizers
    for group in opt.param_groups:
        opt._init_group(group, skip_non_grad_params=False)


def adam_init(opt, config=None):  # megatron-core's init_state_fn of its Adam
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def build(lion_too):
    w = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    b = torch.nn.Parameter(torch.randn(3).bfloat16())
    model = {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0),
             "b": ShardedTensor.from_rank_offsets("b", b, replica_id=0)}
    if lion_too:
        parts = [Float16OptimizerWithFloat16Params(Lion([w], lr=1e-3), config, None, lion_init),
                 Float16OptimizerWithFloat16Params(torch.optim.AdamW([b], lr=1e-3), config, None, adam_init)]
    else:
        parts = [Float16OptimizerWithFloat16Params(torch.optim.AdamW([w, b], lr=1e-3), config, None, adam_init)]
    return ChainedOptimizer(parts), model


def step(chain):
    for opt in chain.chained_optimizers:
        for group in opt.fp32_from_float16_groups:
            for main in group:
                main.grad = torch.randn_like(main)
        with torch.compiler.set_stance("force_eager"):
            opt.optimizer.step()


def saved_tensors(chain, model):  # the save: megatron-core's preprocessing, as checkpointing.py runs it
    sharded, common = save_preprocess(optimizer_state.model_space_state_dict(chain, model),
                                      validate_access_integrity=False)
    return {t.key: t.data.clone() for t in nested_values(sharded)}, copy.deepcopy(common)


chain, model = build(True)
step(chain)
step(chain)
values, common = saved_tensors(chain, model)
assert not any(".exp_avg_sq.w" in k for k in values) and any(".exp_avg.w" in k for k in values), sorted(values)
assert common[0][optimizer_forms.STORED_FORM]["moments"] == ["exp_avg"]

# Into a fresh Lion run, as loading.py reads it: the template's shards filled, merged with the saved common.
fresh, fresh_model = build(True)
optimizer_forms.check_stored_form(fresh, common, checkpoint="iter_0000003", resharding=False)
template = optimizer_state.model_space_state_dict(fresh, fresh_model, is_loading=True)
sharded, nonpersistent, _ = load_preprocess(template)
sharded, _ = extract_sharded_base(sharded)
for t in nested_values(sharded):
    t.data = values[t.key].clone()
def unwrap(x):
    if isinstance(x, ShardedTensor):
        return x.data
    if isinstance(x, dict):
        return {k: unwrap(v) for k, v in x.items()}
    if isinstance(x, list):
        return [unwrap(v) for v in x]
    return x
state = copy.deepcopy(common)
merge(state, nonpersistent)
merge(state, unwrap(sharded))
optimizer_load.load_model_space_state_dict(fresh, state)
again, again_common = saved_tensors(fresh, fresh_model)
assert sorted(again) == sorted(values) and all(torch.equal(again[k], values[k]) for k in values)
assert again_common[0][optimizer_forms.STORED_FORM] == common[0][optimizer_forms.STORED_FORM]
lion = fresh.chained_optimizers[0].optimizer
assert [set(s) for s in lion.state.values()] == [{"exp_avg"}]
print("ok: a Lion + Adam chain saves Lion's one moment and loads back exactly")

adam, adam_model = build(False)
step(adam)
for target, source, name in ((adam, common, "Lion"), (fresh, saved_tensors(adam, adam_model)[1], "AdamW")):
    try:
        optimizer_forms.check_stored_form(target, source, checkpoint="iter_0000003", resharding=False)
    except CheckpointError as exc:
        assert f"saved by {name} (moments: " in str(exc), exc
    else:
        raise AssertionError("not refused")
print("ok: refused both ways")
"""


def test_megatron_cores_own_optimizers_save_lions_moment_and_refuse_adam():
    """megatron-core's real ``Float16OptimizerWithFloat16Params`` and ``ChainedOptimizer`` around Lion and
    AdamW (a fresh interpreter: the CPU emulation is process-wide)."""
    pytest.importorskip("emerging_optimizers")
    proc = subprocess.run([sys.executable, "-c", REAL], cwd=REPO, env=trainer_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok: ") == 2, proc.stdout
