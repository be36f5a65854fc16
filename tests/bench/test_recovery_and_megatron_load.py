"""``bench recovery`` and the Megatron-LM load figure of ``bench restore``: their arithmetic and parsing
here; whole runs (minutes: several torchrun jobs) behind ``--run-slow``."""

from __future__ import annotations

import json

import pytest

from megatron_ext.bench import megatron_load_bench, recovery_bench

TINY_TRAINER = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32",
                "--vocab-size", "256", "--micro-batch-size", "2", "--hidden-dropout", "0.0",
                "--attention-dropout", "0.0", "--bf16", "--use-distributed-optimizer"]


def test_equal_overhead_interval():
    assert recovery_bench.equal_overhead_interval(0.300, 0.030) == 10  # 300 ms per save vs 30 ms per iteration
    assert recovery_bench.equal_overhead_interval(0.010, 0.030) == 1  # cheaper than ours: every iteration
    assert recovery_bench.equal_overhead_interval(0.300, 0.001) == 50  # capped
    assert recovery_bench.equal_overhead_interval(0.300, -0.002) == 50  # ours below the noise


def test_kill_point_is_half_an_interval_after_a_save():
    assert recovery_bench.kill_point(1) == 4
    assert recovery_bench.kill_point(2) == 5
    assert recovery_bench.kill_point(10) == 25  # saves at 10 and 20, killed half an interval later
    assert recovery_bench.kill_point(3) == 7  # saves at 3, 6: killed after 7, one after the save at 6


def test_read_records_skips_a_line_being_written(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"iteration": 1}\n{"iteration": 2}\n{"iterat')
    assert [r["iteration"] for r in recovery_bench.read_records(str(log))] == [1, 2]
    assert recovery_bench.read_records(str(tmp_path / "missing.jsonl")) == []


def test_megatron_load_timer_parsing():
    log = ("(min, max) time across ranks (ms):\n    load-checkpoint ................................: "
           "(972.72, 981.54)\n")
    assert megatron_load_bench.load_timer_s(log) == pytest.approx(0.98154)
    with pytest.raises(RuntimeError, match="no load-checkpoint timer"):
        megatron_load_bench.load_timer_s("nothing")


def test_megatron_runs_keep_bytecode_as_a_cluster_does(monkeypatch):
    # Compiling megatron_ext at the first load_checkpoint would land in its timer (docs/BENCHMARKS.md).
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = megatron_load_bench._environment()
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_plain_read_reads_each_ranks_files_in_processes_of_their_own(tmp_path):
    """The Megatron load's disk limit: one process per rank, each reading that rank's tensor files."""
    import torch

    from megatron_ext.engine import CheckpointEngine

    store = torch.distributed.HashStore()
    engines = [CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.01, "chunk_size_mb": 1},
                                rank=r, world_size=2, run_id="0123456789ab", commit_store=store) for r in range(2)]
    for rank, engine in enumerate(engines):
        engine.save({"w": torch.full((1 << 18,), float(rank))}, "iter_0000002", version=2)
        engine.commit("iter_0000002")
    for engine in engines:
        engine.shutdown()
    assert megatron_load_bench.plain_read_s(str(tmp_path), 2, 2, 2) > 0
    for streams in (1, 3):  # every byte into fresh pages
        assert megatron_load_bench.plain_read_s(str(tmp_path), 2, 2, streams, fresh=("w",)) > 0
    with pytest.raises(RuntimeError, match="no tensor name holds optimizer"):  # a renamed state is not silently missed
        megatron_load_bench.plain_read_s(str(tmp_path), 2, 2, 1, fresh=megatron_load_bench.MOMENTS)
    with pytest.raises(RuntimeError, match="reader exit codes"):  # a reader that dies is named, not waited for
        megatron_load_bench.plain_read_s(str(tmp_path), 2, 2, 0)


def test_in_rank_read_is_the_slowest_ranks_and_needs_every_rank():
    log = ("[bench megatron-load] rank 1 read its files cold in 0.7500s\n"
           "[bench megatron-load] rank 0 read its files cold in 0.5000s\n")
    assert megatron_load_bench.in_rank_read_s(log, 2) == pytest.approx(0.75)
    with pytest.raises(RuntimeError, match=r"in-rank read of ranks \[1\], not of all 2"):
        megatron_load_bench.in_rank_read_s(log.splitlines()[0], 2)


def test_the_fresh_pages_land_in_private_memory_as_a_tensors_do():
    """``mmap.mmap(-1, n)`` alone maps shared memory (shmem pages, faulted in differently from a tensor's)."""

    def resident_kib() -> dict[str, int]:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssShmem")}

    before = resident_kib()
    memory = megatron_load_bench._private(64 << 20)
    memory[:] = b"\x01" * (64 << 20)
    after = resident_kib()
    assert after["RssAnon"] - before["RssAnon"] >= 60 << 10
    assert after["RssShmem"] - before["RssShmem"] < 4 << 10


def test_fresh_read_plan_sends_only_the_moments_to_fresh_memory():
    """The fresh-memory ceiling reads the moments' bytes into new pages, everything else into a reused buffer."""
    tensors = {"shards/embedding": [0, 64], "shards/optimizer.state.exp_avg.w@0": [64, 96],
               "shards/optimizer.state.exp_avg_sq.w@0": [96, 128], "shards/optimizer.state.fp32_param.w@0": [128, 160],
               "shards/optimizer.state.exp_avg.v@1": [200, 208]}
    index = {name: {"offsets": offsets} for name, offsets in tensors.items()}
    assert megatron_load_bench._segments(index, megatron_load_bench.MOMENTS) == [
        (0, 64, False), (64, 128, True), (128, 160, False), (200, 208, True)]
    assert megatron_load_bench._segments(index, ()) == [(0, 160, False), (200, 208, False)]


def test_needed_read_adds_the_model_shards_another_data_parallel_rank_wrote():
    """What a rank's load needs beyond its own files: the replicated model shards of its (TP, PP) position."""
    def entry(rank, tp, dp):
        return {"rank": rank, "extra": {"layout": {"tp_rank": tp, "pp_rank": 0, "dp_rank": dp}}}

    files = {"rank00000": entry(0, 0, 0), "rank00001": entry(1, 1, 0), "rank00002": entry(2, 0, 1),
             "rank00003": entry(3, 1, 1)}
    assert [name for name, e in files.items() if megatron_load_bench._same_position(e, files, 0)] == ["rank00002"]
    assert [name for name, e in files.items() if megatron_load_bench._same_position(e, files, 3)] == ["rank00001"]
    tensors = {"rng/torch": {}, "shards/tensors/decoder.w@0": {}, "shards/tensors/optimizer.state.exp_avg.w@0#0:8": {},
               "shards/objects/x": {}}
    assert list(megatron_load_bench._replicated(tensors)) == ["shards/tensors/decoder.w@0"]


@pytest.mark.slow
def test_recovery_run_reports_both_ways(tmp_path):
    r = recovery_bench.run(iters=4, warmup=1, workdir=str(tmp_path), model=TINY_TRAINER, max_interval=3, repeats=1)
    for key in ("recovery_s_datastates", "recovery_s_torch_dist", "lost_iters_datastates", "lost_iters_torch_dist",
                "torch_dist_interval", "overhead_s_per_iter_datastates", "cost_s_per_save_torch_dist"):
        assert r[key] is not None, key
    assert r["recovery_s_datastates"] > 0 and r["recovery_s_torch_dist"] > 0
    assert 1 <= r["torch_dist_interval"] <= 3
    for way in ("datastates", "torch_dist"):
        (got,) = r[f"runs_{way}"]
        assert got["resumed_from"] >= 1 and 0 <= got["lost_iters"] <= got["finished_before_kill"]
        assert got["load_s"] > 0 and 0 < got["restart_s"] < got["recovery_s"]
    json.dumps(r)


@pytest.mark.slow
def test_megatron_load_cold_and_warm(tmp_path):
    """Megatron-LM's own pretrain_gpt.py on 2 CPU ranks, a tiny GPT saved both ways and loaded cold and warm."""
    from megatron_ext.testing.megatron_lm import TINY_GPT

    r = megatron_load_bench.measure(str(tmp_path), repeats=1, model=[*TINY_GPT, "--bf16", "--use-distributed-optimizer"])
    if "megatron_load_skipped" in r:
        pytest.skip(r["megatron_load_skipped"])
    for key in ("megatron_load_s_datastates", "megatron_load_s_torch_dist", "megatron_load_s_datastates_warm",
                "megatron_load_s_torch_dist_warm", "megatron_load_speedup", "megatron_load_speedup_warm",
                "megatron_read_ceiling_s", "megatron_load_vs_ceiling", "megatron_load_speedup_bound",
                "megatron_fresh_read_ceiling_s", "megatron_load_speedup_fresh_bound", "megatron_load_vs_fresh_ceiling",
                "megatron_needed_read_ceiling_s", "megatron_load_vs_needed_ceiling", "megatron_in_rank_read_s",
                "megatron_load_vs_in_rank_read"):
        assert r[key] > 0, key
    assert r["megatron_same_training"] is True and len(r["megatron_load_s_datastates_runs"]) == 1
    json.dumps(r)
