"""``bench megatron-e2e``: the log parsing, the rounds' merge, and (``--run-slow``) one whole run at the smallest
size (five short Megatron-LM jobs, about a minute on 2 idle cores) that must give every mode iteration timings;
timing values are not checked (nothing here asserts on time)."""

from __future__ import annotations

import json

import pytest

from helpers.megatron_lm_runs import checkout_or_skip
from megatron_ext import cli
from megatron_ext.bench import megatron_e2e_bench

_LOG = """\
 [2026-11-28 18:49:18.742335] iteration        1/       4 | consumed samples:            8 | elapsed time per iteration (ms): 7987.6 | learning rate: 5.0E-04 |
[2026-11-28 18:49:18.738932] saving checkpoint at iteration       1 to ckpt in torch_dist format
[Rank 0] (after 2 iterations) memory (MB) | allocated: 0.00 [2026-11-28 18:49:20.152468] iteration        2/       4 | consumed samples:           16 | elapsed time per iteration (ms): 4105.7 |
 [2026-11-28 18:49:21.499091] iteration        3/       4 | consumed samples:           24 | elapsed time per iteration (ms): 362.1 |
"""


def test_iteration_time_is_the_wall_time_between_consecutive_log_lines():
    """Also where another rank's output lands in front of a line (rank 0's memory report) or inside it."""
    times = megatron_e2e_bench.iteration_times(_LOG)
    assert list(times) == [2, 3]  # iteration 1 has no predecessor: start-up, not timed
    assert times[2] == pytest.approx((20.152468 - 18.742335, 4.1057))
    assert times[3] == pytest.approx((21.499091 - 20.152468, 0.3621))
    assert megatron_e2e_bench.iteration_times("no iterations") == {}
    cut = _LOG.replace("elapsed time per iteration (ms): 362.1", "elapsed ti")  # another rank's output in it
    assert megatron_e2e_bench.iteration_times(cut)[3] == pytest.approx((21.499091 - 20.152468, None))


def test_rounds_merge_into_medians_with_each_round_and_the_spread():
    rounds = [{"iter_s": 1.0, "megatron_elapsed_s": 0.5, "iterations_timed": [4, 5], "iter_s_runs": [0.9, 1.1]},
              {"iter_s": 3.0, "megatron_elapsed_s": 0.7, "iterations_timed": [4, 5], "iter_s_runs": [2.9, 3.1]}]
    merged = megatron_e2e_bench._merged(rounds)
    assert merged["iter_s"] == pytest.approx(2.0) and merged["iter_s_by_round"] == [1.0, 3.0]
    assert merged["iter_s_spread"] == 2.0 and merged["megatron_elapsed_s"] == pytest.approx(0.6)
    assert merged["iter_s_runs"] == [0.9, 1.1, 2.9, 3.1] and merged["rounds"] == rounds
    one = megatron_e2e_bench._merged(rounds[:1])
    assert one["iter_s_by_round"] == [1.0] and one["iter_s_spread"] == 0.0


def test_the_peers_not_run_say_exactly_why():
    peers = megatron_e2e_bench.PEERS_NOT_RUN
    assert set(peers) == {"torch_dist_async_nvrx", "torch_dist_async_nvrx_constant"}
    for peer in peers.values():
        assert "--async-strategy nvrx" in peer["flags"] and "NVRX_MIN_VERSION" in peer["reason"]
        assert ">= 0.6.0" in peer["reason"] and "0.4.1" in peer["reason"]
    assert "--ckpt-assume-constant-structure" in peers["torch_dist_async_nvrx_constant"]["flags"]
    assert megatron_e2e_bench.SAVES["torch_dist_async_constant"][-1] == "--ckpt-assume-constant-structure"
    log = "torch_dist_async_constant: Megatron-LM exited with 1 (log x)\n$ torchrun ...\nTraceback\nValueError: no"
    assert megatron_e2e_bench._failure(log) == "torch_dist_async_constant: Megatron-LM exited with 1 (log x): " \
                                               "ValueError: no"


@pytest.mark.slow  # five Megatron-LM jobs (about a minute idle): the default run keeps the parsing test
def test_every_mode_gives_iteration_timings(tmp_path, capsys):
    checkout_or_skip()
    code = cli.main(["bench", "megatron-e2e", "--size", "tiny", "--iters", "2", "--warmup", "0", "--repeats", "1",
                     "--json", "--dir", str(tmp_path)])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["modes"]) == set(megatron_e2e_bench.MODES)
    for mode in megatron_e2e_bench.MODES:
        m = r["modes"][mode]
        assert m["iterations_timed"] == [2] and len(m["iter_s_runs"]) == 1, mode
        assert {"iter_s", "iter_s_by_round", "iter_s_spread", "megatron_elapsed_s"} <= set(m) and f"iter_s_{mode}" in r
        assert len(r[f"iter_s_{mode}_by_round"]) == 1
    for key in ("ratio_datastates_vs_none", "ratio_torch_dist_vs_none", "ratio_torch_dist_async_vs_none",
                "ratio_torch_dist_async_constant_vs_none", "speedup_datastates_vs_torch_dist", "ckpt_bytes_per_rank",
                "timing", "targets", "peers_not_run",
                "load_average_before", "load_average_after"):
        assert key in r, key
    assert r["skipped"] == {}
    for mode in ("datastates", "torch_dist", "torch_dist_async", "torch_dist_async_constant"):  # each saved the last
        assert r["modes"][mode]["ckpt_bytes_per_rank"] > 0, mode
        assert r[f"save_call_cpu_s_{mode}"] > 0 and len(r["modes"][mode]["save_call_cpu_s_by_round"]) == 1, mode
    assert r["modes"]["none"]["save_call_cpu_s"] is None  # no save call
    assert "wall time between consecutive iteration log lines" in megatron_e2e_bench.format_table(r)
