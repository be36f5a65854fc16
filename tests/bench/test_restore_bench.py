"""``bench restore``: every headline figure with its rounds (timing values are not checked)."""

from __future__ import annotations

import pytest

from megatron_ext.bench import restore_bench


@pytest.mark.slow  # a whole run, tiny: two rounds of every read and load
def test_restore_reports_each_round_of_the_engine_and_the_peers(tmp_path):
    r = restore_bench.run(0.004, str(tmp_path), threads=2, repeats=2, megatron="off")
    assert r["datastates_bit_exact"] and len(r["rounds"]) == 2
    for name in ("datastates_restore_s", "datastates_restore_gbps", "read_ceiling_gbps", "torch_load_s", "dcp_load_s",
                 "datastates_vs_torch_load", "datastates_vs_dcp_load"):
        assert len(r[f"{name}_by_round"]) == 2 and r[f"{name}_spread"] >= 0, name
    assert r["load_average_before"] and r["load_average_after"]
