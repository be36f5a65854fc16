"""``--optimizer-cpu-offload``: what the adapter reads from megatron-core's hybrid device optimizer and how a load syncs it.

A ``HybridDeviceOptimizer`` (HDO) is built on CPU tensors under the test harness's emulation (the
model's shards stand for device tensors), in a fresh interpreter since the emulation is
process-wide. ``tests/megatron_lm/test_optimizer_cpu_offload.py`` runs it in Megatron-LM's loop.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from helpers.trainer_runs import REPO, trainer_env  # noqa: E402
from megatron_ext.megatron import optimizer_load, optimizer_state  # noqa: E402

HDO = """
import torch
from megatron_ext.testing.cpu_emulation import enable_cpu_emulation
enable_cpu_emulation()
from megatron_ext.testing import megatron_lm
megatron_lm._patch_cuda_queries()
megatron_lm._hybrid_optimizer_on_cpu()
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron_ext.megatron import optimizer_forms, optimizer_load, optimizer_state

torch.manual_seed(0)
shards = [torch.randn(n, dtype=torch.bfloat16) for n in (8, 6, 4, 2)]  # the model's (device) shards
hdo = HybridDeviceOptimizer([{"params": shards[:2], "wd_mult": 1.0}, {"params": shards[2:], "wd_mult": 0.0}],
                            offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW,
                            gpu_optimizer_cls=torch.optim.Adam, param_update_in_fp32=True, lr=1e-2,
                            weight_decay=0.1)


class DistOpt:  # what optimizer_state reads of a DistributedOptimizer
    optimizer = hdo
    model_param_group_index_map = {s: (0 if i < 2 else 1, i % 2) for i, s in enumerate(shards)}


def step():
    for s in shards:
        s.decoupled_grad = torch.ones_like(s)
    hdo.step()
"""


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", HDO + code], cwd=REPO, env=trainer_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_the_emulated_hdo_offloads_half_of_the_device_shards():
    """As on a GPU: the first half of the elements to host copies (a CPU sub-optimizer), the rest stepped on the device."""
    run_python(
        "cpu = [p for sub in hdo.cpu_optimizers for g in sub.param_groups for p in g['params']]\n"
        "assert [p.numel() for p in cpu] == [8, 6] and all(p.dtype == torch.float32 for p in cpu)\n"
        "assert type(hdo.gpu_optimizer) is torch.optim.Adam\n"
        "assert [p.numel() for g in hdo.gpu_optimizer.param_groups for p in g['params']] == [4, 2]\n"
        "assert not any(s.is_cuda for s in shards)  # only while the HDO sorts them\n"
        "step()\n"
        "assert all(len(hdo.state[s]) for s in shards)  # every sub-optimizer stepped its masters\n")


def test_the_save_reads_the_masters_and_moments_the_sub_optimizers_step():
    run_python(
        "step()\n"
        "states = optimizer_forms.sub_optimizer_states(hdo)\n"
        "for s in shards:\n"
        "    t = optimizer_state.param_tensors(DistOpt, s, states)\n"
        "    master = hdo.param_to_inner_param[s]\n"
        "    sub = next(o for o in hdo.sub_optimizers if master in o.state)\n"
        "    assert t['fp32_param'] is master and set(t) <= {'fp32_param', 'exp_avg', 'exp_avg_sq'}\n"
        "    assert all(t[k] is sub.state[master][k] for k in t if k != 'fp32_param')\n"
        "assert optimizer_forms.has_stepped(DistOpt)\n")


def test_a_load_passes_the_loaded_masters_on_to_the_sub_optimizers():
    """megatron-core's setter replaces ``HDO.state`` entries only; without the sync the next step
    would step the stale masters and copy them over the model's shards."""
    run_python(
        "step()\n"
        "loaded = {s: torch.full((s.numel(),), 0.5) for s in shards}\n"
        "for s in shards:\n"
        "    hdo.state[s]['master_param'] = loaded[s]  # what _set_main_param_and_optimizer_states does\n"
        "stale = {s: hdo.param_to_inner_param[s].clone() for s in shards}\n"
        "optimizer_load._sync_hybrid(DistOpt)\n"
        "assert all(torch.equal(hdo.param_to_inner_param[s], loaded[s]) for s in shards)\n"
        "step()  # the copy-back hooks write the stepped masters over the shards\n"
        "for s in shards:\n"
        "    assert torch.equal(s, hdo.param_to_inner_param[s].to(torch.bfloat16))\n"
        "    assert (hdo.param_to_inner_param[s] - 0.5).abs().max() < 0.05  # from the loaded value, not the stale one\n"
        "    assert (stale[s] - 0.5).abs().max() > 0.1\n")


def test_param_group_classes_are_stored_by_name_and_loaded_as_the_runs_own():
    class Sub(torch.optim.AdamW):
        pass

    opt = types.SimpleNamespace(optimizer=types.SimpleNamespace(defaults={"cpu_optimizer_cls": Sub, "lr": 1.0}))
    state = {"optimizer": {"param_groups": [{"cpu_optimizer_cls": Sub, "lr": 0.5, "step": 3}]}, "grad_scaler": None}
    stored = optimizer_state.with_class_names(state)
    group = stored["optimizer"]["param_groups"][0]
    assert group == {"cpu_optimizer_cls": f"{__name__}.{Sub.__qualname__}", "lr": 0.5, "step": 3}
    assert state["optimizer"]["param_groups"][0]["cpu_optimizer_cls"] is Sub  # not changed in place
    loaded = optimizer_state.with_live_classes(opt, stored)
    assert loaded["optimizer"]["param_groups"][0] == {"cpu_optimizer_cls": Sub, "lr": 0.5, "step": 3}
    assert optimizer_state.with_class_names({"optimizer": None}) == {"optimizer": None}


def test_restored_adam_steps_stay_on_the_device_the_optimizer_keeps_them():
    param = torch.nn.Parameter(torch.zeros(2))
    inner = types.SimpleNamespace(param_groups=[{"params": [param], "step": 7}],
                                  state={param: {"step": torch.tensor(0.0, device="meta")}})
    optimizer_load.restore_adam_steps(types.SimpleNamespace(optimizer=inner))
    assert inner.state[param]["step"].device.type == "meta"
    inner.state[param]["step"] = torch.tensor(0.0)
    optimizer_load.restore_adam_steps(types.SimpleNamespace(optimizer=inner))
    assert inner.state[param]["step"].item() == 7.0
