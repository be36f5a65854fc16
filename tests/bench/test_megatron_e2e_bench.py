"""``bench megatron-e2e``: the log parsing, and (``--run-slow``) one whole run at the smallest size (four
short Megatron-LM jobs, about a minute on 2 idle cores) that must give every mode iteration timings;
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


@pytest.mark.slow  # four Megatron-LM jobs (about a minute idle): the default run keeps the parsing test
def test_every_mode_gives_iteration_timings(tmp_path, capsys):
    checkout_or_skip()
    code = cli.main(["bench", "megatron-e2e", "--size", "tiny", "--iters", "2", "--warmup", "0", "--json",
                     "--dir", str(tmp_path)])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["modes"]) == set(megatron_e2e_bench.MODES)
    for mode in megatron_e2e_bench.MODES:
        m = r["modes"][mode]
        assert m["iterations_timed"] == [2] and len(m["iter_s_runs"]) == 1, mode
        assert {"iter_s", "megatron_elapsed_s"} <= set(m) and f"iter_s_{mode}" in r
    for key in ("ratio_datastates_vs_none", "ratio_torch_dist_vs_none", "ratio_torch_dist_async_vs_none",
                "speedup_datastates_vs_torch_dist", "ckpt_bytes_per_rank", "timing", "targets",
                "load_average_before", "load_average_after"):
        assert key in r, key
    for mode in ("datastates", "torch_dist", "torch_dist_async"):  # each saved the last iteration
        assert r["modes"][mode]["ckpt_bytes_per_rank"] > 0, mode
    assert "wall time between consecutive iteration log lines" in megatron_e2e_bench.format_table(r)
