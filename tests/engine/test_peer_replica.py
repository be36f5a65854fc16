"""Peer replicas in host memory: losing one simulated node of two is recovered from the other's RAM.

Four gloo ranks, two per simulated node. A run checkpoints with peer replicas on, then every rank
is SIGKILLed. Node 1's memory and disk are wiped (its replica directory and node-local level);
the restart must recover node 1's ranks from the replicas node 0 holds, node 0's from its own
node-local level, and continue bit-exactly like the uninterrupted run. A corrupted replica makes
its rank fall back to the shared file system, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import ConfigError, EngineConfig, read_manifest
from megatron_ext.engine.save.replicas.peer_link import BundleMeta
from megatron_ext.engine.save.replicas.replica import holder_of, resolve_ranks_per_node, source_of
from megatron_ext.engine.save.replicas.replica_store import ReplicaStore

from helpers.procs import REPO, child_env, torchrun_command
from helpers.states import TINY

HERE = Path(__file__).resolve().parent

WORLD = 4
SAVE_UNTIL, STEPS = 4, 6


def _torchrun(phase: str, work: Path, replica_dir: Path) -> subprocess.CompletedProcess:
    cmd = torchrun_command(WORLD, str(HERE / "_replica_worker.py"), phase, str(work), str(replica_dir))
    return subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=300)


def _outcomes(work: Path, phase: str) -> list[dict]:
    return [json.loads((work / "out" / f"{phase}-rank-{r}.json").read_text()) for r in range(WORLD)]


def _lose_node_1(work: Path, replica_dir: Path) -> None:
    """Node 1's host memory and local disk are gone with it."""
    shutil.rmtree(replica_dir / "node-00001")
    shutil.rmtree(work / "local" / "node-1")


def _resume_and_check(work: Path, replica_dir: Path, trained: list[dict], levels: list[str]) -> str:
    proc = _torchrun("resume", work, replica_dir)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for o, before, level in zip(_outcomes(work, "resume"), trained, levels):
        assert o["loaded"] == f"step{SAVE_UNTIL:03d}"
        assert o["level"] == level, (o["rank"], o["level"])
        assert o["reloaded_same"], o["rank"]
        resumed = {int(k): v for k, v in o["losses"].items()}
        assert sorted(resumed) == list(range(SAVE_UNTIL + 1, STEPS + 1))
        for step, loss in resumed.items():  # bit-exact with the uninterrupted run
            assert loss == before["losses"][str(step)], (o["rank"], step)
    # A normal end frees the host memory the replicas held.
    assert not list(replica_dir.glob("node-*/of-rank-*")), list(replica_dir.rglob("*"))
    return proc.stderr


@pytest.mark.multiproc
def test_node_loss_is_recovered_from_peer_memory_bit_exact_or_from_storage_when_corrupt(tmp_path):
    work = tmp_path / "a"
    (work / "out").mkdir(parents=True)
    replica_dir = Path("/dev/shm") / f"megatron_ext-test-{uuid.uuid4().hex[:8]}"
    copy_replicas = replica_dir.with_name(replica_dir.name + "-b")
    try:
        proc = _torchrun("train", work, replica_dir)
        assert proc.returncode != 0  # every rank SIGKILLed itself
        trained = _outcomes(work, "train")
        for o in trained:  # the last checkpoint reached the peers before the kill
            assert o["replica_events"][-1] == f"step{SAVE_UNTIL:03d}", o
        # Bounded: each holder keeps one replica (the newest committed), plus nothing older.
        held = sorted(p.relative_to(replica_dir).as_posix() for p in replica_dir.glob("node-*/of-rank-*/step*"))
        assert held == [f"node-{n:05d}/of-rank-{source_of(r, WORLD, 2):05d}/step{SAVE_UNTIL:03d}"
                        for n, r in ((0, 0), (0, 1), (1, 2), (1, 3))], held

        # Case B starts from a copy of the same crash, with rank 2's replica damaged.
        shutil.copytree(work, tmp_path / "b")
        shutil.copytree(replica_dir, copy_replicas)

        _lose_node_1(work, replica_dir)
        log = _resume_and_check(work, replica_dir, trained, ["local", "local", "peer", "peer"])
        assert "recovered rank 2 from peer memory (rank 0)" in log
        assert log.count("recovered rank 3 from peer memory (rank 1)") == 1  # the second load reused it
        assert "rank 0 reads its files of step004 from its node-local level" in log

        work_b = tmp_path / "b"
        _lose_node_1(work_b, copy_replicas)
        victim = next((copy_replicas / "node-00000" / "of-rank-00002" / f"step{SAVE_UNTIL:03d}").glob("*.safetensors"))
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
        log = _resume_and_check(work_b, copy_replicas, trained, ["local", "local", "shared", "peer"])
        assert "rank 2: the replica held by rank 0 is unusable" in log and "fails its checksum" in log
        assert "recovering rank 2 from the shared file system" in log
        assert "recovered rank 3 from peer memory (rank 1)" in log
    finally:
        shutil.rmtree(replica_dir, ignore_errors=True)
        shutil.rmtree(copy_replicas, ignore_errors=True)


@pytest.mark.multiproc
def test_ranks_committing_in_different_orders_fail_with_a_clear_error(tmp_path):
    (tmp_path / "out").mkdir()
    replica_dir = Path("/dev/shm") / f"megatron_ext-test-{uuid.uuid4().hex[:8]}"
    try:
        proc = _torchrun("misordered", tmp_path, replica_dir)
        assert proc.returncode == 0, proc.stderr[-6000:]
        for o in _outcomes(tmp_path, "misordered"):  # the background failure reached every training thread
            assert o["error"] and "ranks must commit checkpoints in the same order" in o["error"], o
    finally:
        shutil.rmtree(replica_dir, ignore_errors=True)


def test_peer_mapping_and_refusals(monkeypatch):
    assert [holder_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [holder_of(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert all(source_of(holder_of(r, 6, 2), 6, 2) == r for r in range(6))
    with pytest.raises(ConfigError, match="needs at least two nodes"):
        resolve_ranks_per_node(4, 4)
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        resolve_ranks_per_node(3, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="needs ranks_per_node"):
        resolve_ranks_per_node(None, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_ranks_per_node(None, 4) == 2
    with pytest.raises(ConfigError, match="ranks_per_node must be a whole number"):
        EngineConfig.from_dict({"peer_replica": True, "ranks_per_node": 0})
    with pytest.raises(ConfigError, match="peer_replica must be true or false"):
        EngineConfig.from_dict({"peer_replica": "yes"})


def test_holder_keeps_the_newest_committed_replica_and_offers_only_exact_copies(make_engine, tmp_path):
    engine = make_engine(**TINY)
    for version in (1, 2):
        engine.save({"w": torch.arange(5000.0) * version, "v": version}, f"c{version}", version=version)
        engine.commit(f"c{version}")
    engine.wait_persisted()
    root = tmp_path / "ckpt"
    manifests = {c: read_manifest(str(root / c)) for c in ("c1", "c2")}
    store = ReplicaStore(str(tmp_path / "shm" / "node-00000"), source=0)

    def hold(checkpoint: str, version: int, run_id: str) -> None:
        incoming = Path(store.begin())
        for entry in (manifests.get(checkpoint) or {"files": {}})["files"].values():
            for key in ("tensor_file", "state_file"):
                (incoming / entry[key]).parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as _Sink does
                shutil.copy(root / entry[key], incoming / entry[key])
        store.keep(BundleMeta(checkpoint=checkpoint, version=version, run_id=run_id))

    for version in (1, 2, 3):  # c3: received, not committed yet
        hold(f"c{version}", version, engine.run_id)
    store.prune(str(root))
    assert sorted(p.name for p in Path(store.base).iterdir() if not p.name.startswith(".")) == ["c2", "c3"]

    offer = store.offer("c2", manifests["c2"], 0)
    assert offer.meta.unusable is None and len(offer.meta.files) == 2
    assert offer.meta.files[0].xxh3_64 == manifests["c2"]["files"]["rank00000"]["xxh3_64"]
    assert "no replica of c1 is held" in store.offer("c1", manifests["c1"], 0).meta.unusable
    other_run = dict(manifests["c2"], run_id="0" * 12)
    assert "is of run" in store.offer("c2", other_run, 0).meta.unusable
    tensor_file = Path(store.base) / manifests["c2"]["files"]["rank00000"]["tensor_file"]
    tensor_file.write_bytes(tensor_file.read_bytes()[:-1])
    assert "missing or has the wrong size" in store.offer("c2", manifests["c2"], 0).meta.unusable
