"""``bench ft-heartbeats``: what a rank monitor times, from one rank's section messages; and (``--run-slow``)
one whole run at the smallest size under ft_launcher (three short jobs). Nothing here asserts on time."""

from __future__ import annotations

import json

import pytest

from helpers.megatron_lm_runs import checkout_or_skip
from megatron_ext import cli
from megatron_ext.bench import ft_bench
from megatron_ext.testing import megatron_lm


def _messages(*events: tuple[float, str, str]) -> list[dict]:
    return [{"t": t, "section": s, "action": a} for t, s, a in events]


# Megatron-LM's loop with --ft-num-warmup-iters 1: setup, iteration 1 (no step section), its save and
# the next finalize, then step sections; here three steps after the first.
RANK = _messages(
    (0.0, "setup", "open"), (5.0, "setup", "close"),
    (6.0, "checkpointing", "open"), (6.1, "checkpointing", "close"),  # iteration 1's save
    (6.2, "checkpointing", "open"), (6.3, "checkpointing", "close"),  # iteration 2's finalize
    (6.4, "step", "open"), (7.4, "step", "close"),
    (7.5, "checkpointing", "open"), (7.6, "checkpointing", "close"),
    (7.7, "checkpointing", "open"), (7.8, "checkpointing", "close"),
    (7.9, "step", "open"), (9.4, "step", "close"),
    (9.6, "checkpointing", "open"), (9.7, "checkpointing", "close"),
    (9.9, "step", "open"), (10.9, "step", "close"),
    (11.0, "checkpointing", "open"),  # the end's wait: after the last step, left out
)


def test_the_monitor_view_times_sections_gaps_and_silences_after_the_warm_up_steps():
    view = ft_bench.monitor_view(RANK, warmup=1)
    assert view["step_s"] == pytest.approx([1.5, 1.0])
    assert view["checkpointing_s"] == pytest.approx([0.1, 0.1, 0.1])
    assert view["out_of_section_s"] == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2])
    assert max(view["silence_s"]) == pytest.approx(1.5) and len(view["silence_s"]) == 10
    assert ft_bench.monitor_view(RANK, warmup=0)["step_s"] == pytest.approx([1.0, 1.5, 1.0])
    with pytest.raises(ValueError, match="3 step sections, none after the 3 left out"):
        ft_bench.monitor_view(RANK, warmup=3)


@pytest.mark.slow  # three jobs under ft_launcher (about a minute idle)
def test_every_mode_gives_the_monitors_view(tmp_path, capsys):
    checkout_or_skip()
    if megatron_lm.nvrx_missing():
        pytest.skip(megatron_lm.nvrx_missing())
    code = cli.main(["bench", "ft-heartbeats", "--size", "tiny", "--iters", "4", "--warmup", "1", "--repeats", "1",
                     "--json", "--dir", str(tmp_path)])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["modes"]) == set(ft_bench.MODES)
    for mode, m in r["modes"].items():
        assert m["step_s"]["n"] == 2 * 2, mode  # two ranks, steps 3 and 4 (step 1 has no section)
        assert len(m["step_s_by_round"]) == 1 and m["silence_s"]["n"] > 0, mode
    assert {"datastates_vs_none", "torch_dist_vs_none", "ft_launcher_options"} <= set(r)
    assert "longest silence" in ft_bench.format_table(r)
