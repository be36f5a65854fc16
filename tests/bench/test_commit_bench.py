"""``bench commit`` runs the real committer at several simulated world sizes and prints the keys
the issue asks for; a rank's file-system and store calls per checkpoint do not grow with the
number of ranks (counted, not timed)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.procs import child_env


def test_bench_commit_json_and_per_rank_costs_independent_of_world_size(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "commit", "--ranks", "8", "64",
                           "--tensors", "5", "--checkpoints", "2", "--repeats", "1", "--dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    rows = {r["ranks"]: r for r in out["results"]}
    assert set(rows) == {8, 64}
    for row in rows.values():
        assert {"ranks", "tensors_per_rank", "commit_latency_s", "metadata_ops_per_rank", "rank0_cpu_s",
                "manifest_bytes"} <= set(row)
        assert row["tensors_per_rank"] == 5 and row["commit_latency_s"] > 0 and row["manifest_bytes"] > 0
        assert len(row["commit_latency_s_by_round"]) == 1 and row["commit_latency_s_spread"] == 0
    # a handful of calls (report: mkdir, temp file, rename, directory fsync), whatever the world size; which
    # rank creates .reports first (one stat more or less) varies
    assert 0 < rows[64]["metadata_ops_per_rank"] <= rows[8]["metadata_ops_per_rank"] + 1 <= 11
    # the append of its record (head and shares of the manifest), the status's append, add, wait, get; and set
    # by the one rank whose add completes the count
    assert all(5 <= row["store_ops_per_rank"] <= 6 for row in rows.values())
    # at 8 ranks (groups of 3) ranks 3 and 6 lead theirs: besides their own, the group's wait, check and
    # multi_get, its record's two appends and add (and set); from the second checkpoint on, the deletion of
    # the group's older keys
    assert rows[8]["groups"] == 3 and 11 <= rows[8]["store_ops_per_leader"] <= 19
    assert rows[64]["groups"] == 8 and rows[64]["store_ops_per_leader"] is None  # sampled ranks 1-7: rank 0's group
    assert rows[64]["metadata_ops_rank0"] <= rows[8]["metadata_ops_rank0"] + 1
