"""``bench python-loop``: its JSON keys with every mode, on a tiny state (figures are not checked: no timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.bench import python_loop_bench

REPO = Path(__file__).resolve().parents[2]
#: The default test leaves torch_checkpointing out (its writer subprocess's spawn takes seconds); the slow one runs it.
MODES = ("none", "datastates", "dcp_async", "dcp_stager", "dcp_process")


def test_python_loop_json_keys_with_every_mode_and_the_account(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "python-loop", "--size-gb", "0.004",
                           "--work-s", "0.05", "--iters", "3", "--warmup", "1", "--repeats", "1", "--account", "--modes", *MODES,
                           "--plot", str(tmp_path / "loop.png"), "--dir", str(tmp_path / "work"), "--json"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    for mode in MODES:
        assert r[f"iter_s_{mode}"] > 0 and len(r[f"iter_s_{mode}_rounds"]) == 1
        assert r[f"iter_s_{mode}_by_round"] == r[f"iter_s_{mode}_rounds"] and r[f"iter_s_{mode}_spread"] == 0
        if mode != "none":
            assert r[f"ratio_{mode}"] == pytest.approx(r[f"iter_s_{mode}"] / r["iter_s_none"])
    for stage in python_loop_bench.STAGES:
        assert f"iter_s_datastates_no_{stage}" in r and stage in r["gil_account_s_per_iter"]
    # The account names the engine's snapshot thread where the engine runs (however little CPU it took
    # for a tiny state), and only there.
    assert "datastates-snapshot" in r["thread_cpu_s_per_iter_datastates"]
    assert not any(name.startswith("datastates-") for name in r["thread_cpu_s_per_iter_none"])
    assert r["ratio_datastates_vs_best_dcp"] > 0 and (tmp_path / "loop.png").stat().st_size > 0
    assert not (tmp_path / "work" / "datastates").exists()  # each child's checkpoints are removed



@pytest.mark.slow
def test_python_loop_runs_torch_checkpointing_over_two_rounds(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "python-loop", "--size-gb", "0.004",
                           "--work-s", "0.05", "--iters", "3", "--warmup", "1", "--repeats", "2", "--modes",
                           "datastates", "torch_checkpointing", "--dir", str(tmp_path / "work"), "--json"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["skipped"] == {} and len(r["iter_s_torch_checkpointing_by_round"]) == 2
    assert r["iter_s_torch_checkpointing_spread"] >= 0 and r["ratio_datastates_vs_torch_checkpointing"] > 0


def test_a_peer_that_cannot_run_is_named_with_its_reason(monkeypatch, tmp_path):
    from megatron_ext.bench import torch_checkpointing_peer

    monkeypatch.setattr(torch_checkpointing_peer, "missing", lambda: "not installed here")
    monkeypatch.setattr(python_loop_bench, "calibrate", lambda work_s: 1)
    monkeypatch.setattr(python_loop_bench, "_run_child", lambda mode, *a: {
        "iter_s": [1.0, 2.0], "blocked_s": [0.0, 0.0], "offcpu_s": [0.0, 0.0], "thread_cpu_s": {}})
    r = python_loop_bench.run(iters=2, warmup=1, repeats=2, modes=("none", "torch_checkpointing"),
                              directory=str(tmp_path))
    assert r["skipped"] == {"torch_checkpointing": "not installed here"} and "iter_s_torch_checkpointing" not in r
    assert r["iter_s_none_by_round"] == [2.0, 2.0] and r["iter_s_none_spread"] == 0
