"""``bench engine`` prints the same JSON keys for ``--device cpu`` and (on a GPU node, tests/gpu) ``cuda``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
#: Measured once per run (the physical limits of memory) or not figures at all.
ONCE = {"state_bytes", "rss_with_state_bytes", "device", "flush_process", "memcpy_gbps", "d2h_gbps", "repeats",
        "load_average_before", "load_average_after", "skipped", "workdir"}
#: Measured once per round: each is reported as its median, ``_by_round`` and ``_spread``.
PER_ROUND = {"host_cache_bytes",
        "datastates_save_call_s", "datastates_blocking_s", "datastates_snapshot_s", "datastates_compute_s",
        "datastates_compute_steps", "datastates_persisted_s", "datastates_flush_s", "datastates_flush_gbps",
        "torch_checkpointing_blocking_s", "torch_checkpointing_call_s", "torch_checkpointing_staged_s",
        "torch_checkpointing_done_s", "ratio_blocking_vs_torch_checkpointing",
        "peak_rss_bytes", "direct_write_gbps_before", "direct_write_gbps_after", "direct_write_gbps", "torch_save_s",
        "dcp_async_blocking_s", "dcp_async_done_s", "dcp_stager_blocking_s", "dcp_stager_call_s",
        "dcp_stager_staged_s", "dcp_stager_done_s", "ratio_blocking_vs_dcp", "ratio_blocking_vs_dcp_stager",
        "ratio_flush_vs_direct", "datastates_cpu_s_per_gb", "floor_checksum_cpu_s_per_gb", "floor_write_cpu_s_per_gb",
        "floor_cpu_s_per_gb", "ratio_cpu_vs_floor", "datastates_warm_flush_gbps", "datastates_warm_cpu_s_per_gb",
        "ratio_warm_flush_vs_direct", "ratio_warm_cpu_vs_floor", "datastates_warm_copy_cpu_s_per_gb",
        "ratio_warm_cpu_besides_copy_vs_floor",
        "ratio_rss_vs_state_plus_cache"}
KEYS = ONCE | PER_ROUND | {f"{k}_by_round" for k in PER_ROUND} | {f"{k}_spread" for k in PER_ROUND}


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "engine", *args], cwd=str(REPO),
                          capture_output=True, text=True, timeout=300)


def test_bench_engine_json_keys_on_cpu(tmp_path):
    plot = tmp_path / "cpu_vs_floor.png"
    proc = _bench("--size-gb", "0.01", "--compute-s", "0.05", "--repeats", "1", "--json", "--dir", str(tmp_path),
                  "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert set(result) == KEYS
    assert result["device"] == "cpu" and result["d2h_gbps"] is None and result["datastates_blocking_s"] > 0
    # The engine's CPU counts its threads and its I/O worker: at least the floor's checksum pass.
    assert result["datastates_cpu_s_per_gb"] > result["floor_checksum_cpu_s_per_gb"] > 0
    # The copy's threads are found by the snapshot thread's OS name: some CPU, less than the engine's.
    assert 0 < result["datastates_warm_copy_cpu_s_per_gb"] < result["datastates_warm_cpu_s_per_gb"]
    assert plot.read_bytes().startswith(b"\x89PNG") and f"wrote {plot}" in proc.stderr
    assert result["flush_process"] is True and result["skipped"] == {}
    assert result["datastates_blocking_s_by_round"] == [result["datastates_blocking_s"]]


def test_bench_engine_flushes_in_process_when_asked(tmp_path):
    proc = _bench("--size-gb", "0.01", "--compute-s", "0.05", "--repeats", "1", "--json", "--dir", str(tmp_path),
                  "--flush-in-process", "--modes", "datastates")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["flush_process"] is False and result["datastates_flush_gbps"] > 0
    assert "ratio_blocking_vs_dcp" not in result and result["skipped"] == {}  # only the modes asked for


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs --device cuda on a GPU")
def test_bench_engine_cuda_without_a_gpu_says_so():
    proc = _bench("--device", "cuda", "--size-gb", "0.01")
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and not proc.stdout


def test_limits_are_checked_not_just_the_exit_status():
    """``bench engine --check`` (and scripts/gpu_check.sh) fail a run whose figures break a limit."""
    from megatron_ext.bench.engine_bench import check_limits

    good = {"ratio_blocking_vs_dcp": 0.001, "ratio_flush_vs_direct": 0.95, "ratio_rss_vs_state_plus_cache": 1.02,
            "d2h_gbps": 40.0, "state_bytes": 4e9, "datastates_compute_s": 1.0, "datastates_snapshot_s": 1.1}
    assert check_limits(good) == []
    assert check_limits({**good, "ratio_blocking_vs_dcp": None})[0].startswith("ratio_blocking_vs_dcp not measured")
    assert check_limits({**good, "d2h_gbps": None, "datastates_snapshot_s": 9.0}) == []  # CPU: no d2h limit
    bad = check_limits({**good, "ratio_blocking_vs_dcp": 0.5, "ratio_flush_vs_direct": 0.5,
                        "datastates_snapshot_s": 1.8})
    assert [line.split()[0] for line in bad] == ["ratio_blocking_vs_dcp", "ratio_flush_vs_direct",
                                                 "datastates_snapshot_s"], bad


@pytest.mark.slow
def test_a_peer_that_fails_is_named_with_its_reason_and_the_rest_still_runs(monkeypatch, tmp_path):
    from megatron_ext.bench import engine_bench

    def refuses(*args, **kwargs):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(engine_bench, "measure_torch_checkpointing", refuses)
    r = engine_bench.run(0.002, str(tmp_path), compute_s=0.0, repeats=2)
    assert r["skipped"] == {"torch_checkpointing": "round 1: OSError: [Errno 22] Invalid argument"}
    assert not any(k.startswith("torch_checkpointing") or k.endswith("torch_checkpointing") for k in r)
    assert len(r["ratio_blocking_vs_dcp_by_round"]) == 2
