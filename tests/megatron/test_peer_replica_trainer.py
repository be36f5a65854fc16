"""The reference trainer with --datastates-peer-replica: one simulated node of two lost, resumed bit-exact.

TP1 x DP4 on 4 CPU ranks, 2 per simulated node, a checkpoint every 2 iterations and no node-local
level, so on restart every rank asks its holder. Every rank is SIGKILLed one iteration after the
checkpoint of iteration 4; node 1's replica directory is wiped. Ranks 2 and 3 must recover from
the replicas node 0 holds, ranks 0 and 1 (whose replicas died with node 1) from the shared file
system, and every later loss must equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from helpers.trainer_runs import COMMON, REPO, RUN_TIMEOUT_S, run_trainer, trainer_command, trainer_env

pytest.importorskip("megatron.core")

ITERS, SAVE_AT, CRASH_AT = 8, 4, 5


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_recovers_a_lost_node_from_peer_memory(tmp_path: Path):
    reference = {r["iteration"]: (r["loss"], r["lr"]) for r in
                 run_trainer(4, ["--train-iters", str(ITERS)], tmp_path / "reference.jsonl")}
    replica_dir = Path("/dev/shm") / f"megatron_ext-test-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", str(ITERS), "--save", str(ckpt), "--save-interval", "2", "--use-datastates",
             "--datastates-host-cache-size", "0.02", "--datastates-peer-replica", "--datastates-ranks-per-node", "2",
             "--datastates-replica-dir", str(replica_dir)]
    try:
        run_trainer(4, [*flags, "--crash-at-iteration", str(CRASH_AT), "--committed-before-crash", str(SAVE_AT)],
                    tmp_path / "crashed.jsonl", expect_crash=True)
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(SAVE_AT)
        markers = replica_dir.glob(f"node-00000/of-rank-*/iter_{SAVE_AT:07d}/replica.json")
        held = sorted(p.parent.parent.name for p in markers)
        assert held == ["of-rank-00002", "of-rank-00003"], "node 0 did not hold the replicas one iteration later"
        shutil.rmtree(replica_dir / "node-00001")  # node 1's memory is gone

        # The restart sizes its host cache itself (auto): the run's engine reads (recovery from peers is
        # its collective), so it is created before the load, sized from the manifest (an error otherwise).
        resume_flags = [a if a != "0.02" else "auto" for a in flags]
        cmd = trainer_command(4, *COMMON, *resume_flags, "--load", str(ckpt), "--log-json",
                              str(tmp_path / "resumed.jsonl"))
        proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-8000:]
        for rank, holder in ((2, 0), (3, 1)):
            assert f"recovered rank {rank} from peer memory (rank {holder})" in proc.stderr
        for rank, holder in ((0, 2), (1, 3)):
            assert (f"rank {rank}: the replica held by rank {holder} is unusable (no replica of "
                    f"iter_{SAVE_AT:07d} is held); recovering rank {rank} from the shared file system") in proc.stderr
        resumed = {r["iteration"]: (r["loss"], r["lr"]) for r in
                   (json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines())}
        assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
        for it, value in resumed.items():
            assert value == reference[it], f"iteration {it}: {value} != {reference[it]}"
        assert not replica_dir.exists()  # a normal end frees the replicas
    finally:
        shutil.rmtree(replica_dir, ignore_errors=True)
