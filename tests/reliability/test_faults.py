"""Fault injection in the writers on 2 gloo ranks: one clear error on every rank, nothing lost.

Each fault hits rank 1 while it writes checkpoint c002 (the hook in megatron_ext.engine.faults):
no space left, an I/O error, a slow file system, a writer thread that dies, a rank that never
reports. Afterwards c001 must still be committed and load bit-exact; with on_failure=stop every
rank raises and stays stopped, with on_failure=continue c002 is abandoned everywhere and c003
commits. Only the rank that never reports runs under the short timeout it waits out; the others get
one far longer than the run, so no verdict depends on how fast a loaded machine is, and the error
message, not a clock, says which verdict it was.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine
from helpers.procs import torchrun_command

HERE = Path(__file__).parent
TIMEOUT_S = 6  # what the rank that never reports waits out
LONG_TIMEOUT_S = 120  # beyond what any of these runs needs: only a rank's own report ends a wait


def _run(tmp_path: Path, fault: str, on_failure: str, timeout_s: int = LONG_TIMEOUT_S, ranks: int = 2,
         fault_rank: int = 1) -> dict[int, dict]:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir(parents=True)
    env = dict(os.environ, FAULT=fault, FAULT_RANK=str(fault_rank), ON_FAILURE=on_failure, TIMEOUT=str(timeout_s),
               OMP_NUM_THREADS="1")
    cmd = torchrun_command(ranks, str(HERE / "fault_worker.py"), str(root), str(out))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LONG_TIMEOUT_S + 120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)}


def _assert_c001_intact(root: Path, ranks: int = 2) -> None:
    with CheckpointEngine({"save_dir": str(root), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        for rank in range(ranks):
            state = engine.load("c001", f"r{rank}")
            assert torch.equal(state["w"], torch.full((200_000,), float(1 + rank))) and state["step"] == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("fault, message", [
    ("enospc", "No space left on device"),
    ("eio", "Input/output error"),
    ("writer_dies", "writer thread killed"),
])
def test_write_fault_stops_every_rank_with_one_clear_error(tmp_path, fault, message):
    outcome = _run(tmp_path, fault, "stop")
    for rank in range(2):
        c002 = outcome[rank]["c002"]
        assert not c002["ok"] and message in c002["error"], (rank, c002)
        assert "not every rank reported" not in c002["error"]  # the peer's error report, not a timeout
        assert not outcome[rank]["c003"]["ok"]  # stopped: the engine refuses to go on
    assert "failed on rank 1" in outcome[0]["c002"]["error"]
    assert not (tmp_path / "ckpt" / "c002" / "manifest.json").exists()
    _assert_c001_intact(tmp_path / "ckpt")


@pytest.mark.multiproc
def test_continue_abandons_the_failed_checkpoint_and_trains_on(tmp_path):
    outcome = _run(tmp_path, "enospc", "continue")
    for rank in range(2):
        assert outcome[rank]["c002"]["ok"]  # nothing raised: the failure was logged and skipped
        assert outcome[rank]["c003"]["ok"] and outcome[rank]["latest"] == "c003"
        assert "shutdown_error" not in outcome[rank]
    assert not (tmp_path / "ckpt" / "c002" / "manifest.json").exists()
    telemetry = (tmp_path / "ckpt" / "datastates_telemetry" / "rank-00001.jsonl").read_text()
    assert '"event": "failed"' in telemetry and "No space left" in telemetry
    _assert_c001_intact(tmp_path / "ckpt")


@pytest.mark.multiproc
def test_slow_file_system_still_commits(tmp_path):
    outcome = _run(tmp_path, "slow", "stop")
    for rank in range(2):
        assert all(outcome[rank][c]["ok"] for c in ("c001", "c002", "c003")), outcome[rank]
        assert outcome[rank]["latest"] == "c003"


@pytest.mark.multiproc
def test_rank_that_never_reports_times_out_on_every_rank(tmp_path):
    outcome = _run(tmp_path, "never_report", "stop", timeout_s=TIMEOUT_S)
    assert not outcome[0]["c002"]["ok"]
    error = outcome[0]["c002"]["error"]
    assert f"not every rank reported its files durable within {TIMEOUT_S}s (missing ranks: 1)" in error, error
    # Not before the timeout (a lower bound the engine's own deadline implies; no upper bound on a shared
    # machine: the message above says the timeout decided, not how long the machine took to say so).
    assert outcome[0]["c002"]["seconds"] >= TIMEOUT_S
    assert not outcome[1]["c002"]["ok"]  # it never saved c002: waiting for it is an error too
    _assert_c001_intact(tmp_path / "ckpt")


@pytest.mark.multiproc
def test_four_ranks_in_two_commit_groups_a_leader_fault_and_a_silent_member(tmp_path):
    """Four processes commit in two groups (0-1, 2-3) through the job's TCPStore. Rank 2 leads the
    second group: its full disk stops every rank with its own error (its group's failure, forwarded,
    not a timeout). Then, in a second run, rank 3 never reports: rank 0 names it when its wait runs out."""
    outcome = _run(tmp_path / "leader", "enospc", "stop", ranks=4, fault_rank=2)
    for rank in range(4):
        c002 = outcome[rank]["c002"]
        assert not c002["ok"] and "No space left on device" in c002["error"], (rank, c002)
        assert "not every rank reported" not in c002["error"] and "did not forward" not in c002["error"]
    assert "failed on rank 2" in outcome[0]["c002"]["error"]
    _assert_c001_intact(tmp_path / "leader" / "ckpt", ranks=4)

    outcome = _run(tmp_path / "member", "never_report", "stop", timeout_s=TIMEOUT_S, ranks=4, fault_rank=3)
    error = outcome[0]["c002"]["error"]
    assert f"not every rank reported its files durable within {TIMEOUT_S}s (missing ranks: 3)" in error, error
    assert all(not outcome[rank]["c002"]["ok"] for rank in range(4))
    _assert_c001_intact(tmp_path / "member" / "ckpt", ranks=4)
