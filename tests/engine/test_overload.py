"""Overload policy (issue 10): two gloo ranks checkpoint every iteration through a throttled writer.

With "supersede" no ``wait_snapshot`` waits for the flush (the engine's own count), skipped
checkpoints are in the telemetry with their reason, no skipped checkpoint is committed on any
rank, and every committed one verifies and loads bit-exact with the state saved under its id.
The durable-age bound turns supersede back into waits; "wait" keeps today's behaviour.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, ConfigError, EngineConfig
from megatron_ext.engine.read.inspect import describe
from megatron_ext.engine.read.verify import verify_root

from helpers.procs import REPO, child_env, torchrun_command
from helpers.states import FAST, TINY, assert_same, committed_names, step_state

HERE = Path(__file__).resolve().parent


WORLD = 2


def _run(tmp_path, policy: str, iters: int, *extra: str) -> tuple[list[dict], list[str]]:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    cmd = torchrun_command(WORLD, str(HERE / "_overload_worker.py"), str(root), str(out), policy, str(iters), *extra)
    proc = subprocess.run(cmd, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    outcomes = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    return outcomes, committed_names(root)


def _check_committed(root, committed: list[str]) -> None:
    checked, problems = verify_root(str(root))
    assert checked == committed and not problems, problems
    with CheckpointEngine({"save_dir": str(root), **TINY, **FAST}) as reader:
        for name in committed:
            for r in range(WORLD):
                assert_same(reader.load(name, f"rank{r:05d}"), step_state(r, int(name.split("_")[1])))


@pytest.mark.multiproc
def test_supersede_never_waits_for_the_flush_and_commits_only_complete_checkpoints(tmp_path):
    iters = 24
    outcomes, committed = _run(tmp_path, "supersede", iters)
    root = tmp_path / "ckpt"
    for o in outcomes:
        assert o["backpressure_waits"] == 0, o  # no wait_snapshot waited for cache space
    skipped = {s["checkpoint"] for o in outcomes for s in o["skipped"]}
    assert skipped, "the throttled writer should force skips"
    assert not skipped & set(committed)  # a skip on any rank abandons it on all
    assert committed and f"it_{iters:04d}" in committed  # the last save is kept (shutdown waits for it)
    # Rank 1 writes slower: rank 0 follows skips it did not decide itself.
    assert any(s["reason"].startswith("skipped by rank 1") for s in outcomes[0]["skipped"]), outcomes[0]
    for o in outcomes:
        for s in o["skipped"]:
            assert s["reason"] in ("superseded", "no_cache_space") or s["reason"].startswith("skipped by rank")
            if s["reason"] == "superseded":
                assert s["superseded_by_version"] > s["version"]
    # Every rank that skipped one on its own left a skip report; the others followed it.
    for name in skipped:
        reports = [p.name for p in (root / name / ".reports").iterdir()]
        assert any(n.endswith(".skipped.json") for n in reports), (name, reports)
        data = [p.name for p in (root / name).iterdir() if p.name != ".reports"]
        assert data == [], (name, data)  # partly written files were removed
    rows = {r["checkpoint"]: r for r in describe(str(root))}
    assert all(rows[name]["skip_reports"] >= 1 and not rows[name]["committed"] for name in skipped)
    _check_committed(root, committed)


@pytest.mark.multiproc
def test_durable_age_bound_forces_waits(tmp_path):
    age = 3
    outcomes, committed = _run(tmp_path, "supersede", 14, str(age))
    assert all(o["age_bound_waits"] > 0 and o["backpressure_waits"] > 0 for o in outcomes), outcomes
    versions = [0] + [int(n.split("_")[1]) for n in committed]
    gaps = [b - a for a, b in zip(versions, versions[1:])]
    assert max(gaps) <= age + 1, (committed, gaps)
    _check_committed(tmp_path / "ckpt", committed)


@pytest.mark.multiproc
def test_wait_policy_commits_every_checkpoint(tmp_path):
    iters = 10  # enough for the cache (about 4 checkpoints) to fill even when iterations are slow
    outcomes, committed = _run(tmp_path, "wait", iters)
    assert committed == [f"it_{i:04d}" for i in range(1, iters + 1)]
    assert all(o["skipped"] == [] and o["backpressure_waits"] > 0 for o in outcomes), outcomes
    _check_committed(tmp_path / "ckpt", committed)


@pytest.mark.parametrize("levels", ["shared", "local+shared"])
def test_a_new_save_supersedes_snapshots_queued_behind_a_full_cache(make_engine, fault, tmp_path, levels):
    gate = threading.Event()
    fault(lambda level, path, offset, nbytes: gate.wait(30) if path.endswith(".safetensors") else None)
    local = {"local_dir": str(tmp_path / "local")} if levels == "local+shared" else {}
    engine = make_engine(**TINY, **local, overload_policy="supersede")
    big = {"w": torch.arange(60_000, dtype=torch.float32)}  # ~240 KB through a ~100 KB cache: it starves
    engine.save(big, "A", version=1)
    engine.commit("A")
    deadline = time.monotonic() + 30
    while engine.scheduler.starved is None:  # the copy of A now waits for the stuck writer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    small = {"w": torch.ones(100)}
    engine.save(small, "B", version=2)  # no wait_snapshot in between: A is replaced, not waited for
    engine.commit("B")
    gate.set()
    # B's copy may itself wait for space until the writer has dropped A's chunks; a wait_snapshot
    # that found it waiting would skip B too (the policy), so let the flush drain first
    deadline = time.monotonic() + 30
    while not all(f.snapshot_done.is_set() for f in engine._files if f.job.checkpoint == "B"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.wait_snapshot()
    engine.wait_persisted()
    assert committed_names(tmp_path / "ckpt") == ["B"]
    skipped = [r for r in engine.telemetry.records if r["event"] == "skipped"]
    assert [(r["checkpoint"], r["reason"], r["superseded_by"]) for r in skipped] == [("A", "superseded", "B")]
    engine.shutdown()  # the removal of A's files runs behind B's flush
    for level_root in [tmp_path / "ckpt"] + ([tmp_path / "local"] if local else []):
        left = [p.name for p in (level_root / "A").iterdir()] if (level_root / "A").exists() else []
        assert [n for n in left if n != ".reports"] == [], level_root
    assert_same(CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST}).load("B"), small)


def test_overload_configuration_errors():
    with pytest.raises(ConfigError, match="overload_policy must be one of"):
        EngineConfig.from_dict({"overload_policy": "drop"})
    with pytest.raises(ConfigError, match="max_durable_age must be a whole number >= 0"):
        EngineConfig.from_dict({"max_durable_age": -1})
    with pytest.raises(ConfigError, match="max_durable_age"):
        EngineConfig.from_dict({"max_durable_age": 2.5})
    assert EngineConfig.from_dict({"overload_policy": "supersede", "max_durable_age": 0}).max_durable_age == 0


def test_age_bound_needs_versions(make_engine):
    engine = make_engine(**TINY, overload_policy="supersede", max_durable_age=2)
    with pytest.raises(Exception, match="max_durable_age needs a version"):
        engine.save({"w": torch.zeros(4)}, "A")


def test_bench_overload_reports_wait_versus_supersede(tmp_path):
    from megatron_ext.bench import overload_bench

    r = overload_bench.run(size_mb=4, iters=6, compute_s=0.05, directory=str(tmp_path / "bench"))
    for key in ("iter_s_wait", "iter_s_supersede", "iter_s_baseline", "max_durable_age_iters_supersede",
                "max_durable_age_iters_wait"):
        assert r[key] is not None and r[key] >= 0, key
    assert r["committed_wait"] == 6 and r["skipped_wait"] == 0
    assert r["backpressure_waits_supersede"] == 0 and r["committed_supersede"] + r["skipped_supersede"] == 6
    json.dumps(r)  # what --json prints


def test_rank_zero_abandons_a_checkpoint_a_peer_skipped_after_reporting_its_own(tmp_path, fault):
    """Rank 0 flushed and reported A, rank 1 skips A: rank 0 stops waiting, removes its files, commits B."""
    gate = threading.Event()
    fault(lambda level, path, offset, nbytes: gate.wait(30) if "rank00001" in path else None)
    cfg = {"save_dir": str(tmp_path / "ckpt"), **TINY, **FAST, "overload_policy": "supersede"}
    store = dist.HashStore()
    ranks = [CheckpointEngine(cfg, rank=r, world_size=2, run_id="0123456789ab", commit_store=store) for r in (0, 1)]
    try:
        ranks[0].save({"w": torch.ones(100)}, "A", version=1)
        ranks[0].commit("A")
        report0 = tmp_path / "ckpt" / "A" / ".reports" / "rank-00000.0123456789ab.json"
        deadline = time.monotonic() + 30
        while not report0.exists():  # rank 0 is now waiting for rank 1's report
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ranks[1].save({"w": torch.arange(60_000, dtype=torch.float32)}, "A", version=1)  # starves: stuck writer
        ranks[1].commit("A")
        while ranks[1].scheduler.starved is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ranks[1].wait_snapshot()  # skips A instead of waiting for the writer
        ranks[0].wait_persisted("A")  # returns: A is abandoned, not an error
        gate.set()
        for r, engine in enumerate(ranks):
            engine.save({"w": torch.full((50,), float(r))}, "B", version=2)
            engine.commit("B")
        for engine in ranks:
            engine.shutdown()
    finally:
        gate.set()
        for engine in ranks:
            engine.shutdown(timeout=10)
    assert committed_names(tmp_path / "ckpt") == ["B"]
    assert [p.name for p in (tmp_path / "ckpt" / "A").iterdir() if p.name != ".reports"] == []
    mine = [r for r in ranks[0].telemetry.records if r["event"] == "skipped"]
    assert [(r["checkpoint"], r["reason"]) for r in mine] == [("A", "skipped by rank 1: no_cache_space")]
    assert ranks[0].backpressure_waits == ranks[1].backpressure_waits == 0
