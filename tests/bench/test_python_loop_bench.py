"""``bench python-loop``: its JSON keys with every mode, on a tiny state (figures are not checked: no timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.bench import python_loop_bench

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "datastates", "dcp_async", "dcp_stager", "dcp_process")


def test_python_loop_json_keys_with_every_mode_and_the_account(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "python-loop", "--size-gb", "0.004",
                           "--work-s", "0.05", "--iters", "3", "--warmup", "1", "--repeats", "1", "--account",
                           "--plot", str(tmp_path / "loop.png"), "--dir", str(tmp_path / "work"), "--json"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    for mode in MODES:
        assert r[f"iter_s_{mode}"] > 0 and len(r[f"iter_s_{mode}_rounds"]) == 1
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

