"""``bench param-sync`` reads its figures from Megatron-LM's log lines (the bench itself runs in notes)."""

from __future__ import annotations

import pytest

from megatron_ext.bench.param_sync_bench import WARMUP, figures


def _log(iterations: int) -> str:
    lines = []
    for i in range(1, iterations + 1):
        lines.append(f" [2026-11-25 17:00:0{i % 10}] iteration {i}/ 14 | elapsed time per iteration (ms): {700 + i}.5 |")
        lines.append(f"[datastates] iteration {i}: checkpoint recorded in 0.02{i % 10}0s (5 tensors, 3 objects owned here)")
        lines.append("(min, max) time across ranks (ms):")
        lines.append(f"    save-checkpoint ................................: ({20 + i}.00, {40 + i}.50)")
    return "\n".join(lines)


def test_figures_are_medians_after_the_warmup_of_the_slowest_rank():
    r = figures(_log(WARMUP + 3))  # iterations 4, 5, 6 count
    assert r["save_ms"] == 45.5  # the max column
    assert r["iter_ms"] == 705.5
    assert r["recorded_ms"] == pytest.approx(25.0)


def test_a_run_too_short_is_refused():
    with pytest.raises(RuntimeError, match="too few"):
        figures(_log(WARMUP))
