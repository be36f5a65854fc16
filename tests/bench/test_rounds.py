"""The rounds convention every bench reports (docs/BENCHMARKS.md, Method): median, ``_by_round``, ``_spread``."""

from __future__ import annotations

from megatron_ext.bench.common import DEFAULT_REPEATS, figure_over_rounds, figures_over_rounds, round_order


def test_modes_are_reversed_every_other_round():
    assert [round_order("abc", r) for r in range(3)] == [list("abc"), list("cba"), list("abc")]
    assert DEFAULT_REPEATS >= 3


def test_a_figure_over_rounds_is_its_median_each_round_and_max_less_min():
    assert figure_over_rounds("x", [3.0, 1.0, 2.0]) == {"x": 2.0, "x_by_round": [3.0, 1.0, 2.0], "x_spread": 2.0}
    assert figure_over_rounds("x", [None, 4.0]) == {"x": 4.0, "x_by_round": [None, 4.0], "x_spread": 0.0}
    assert figure_over_rounds("x", [None]) == {"x": None, "x_by_round": [None], "x_spread": None}


def test_figures_over_rounds_keep_text_and_flags_from_the_first_round():
    got = figures_over_rounds([{"a": 1, "b": "cpu", "c": True}, {"a": 3, "b": "cpu", "c": True}])
    assert got == {"a": 2, "a_by_round": [1, 3], "a_spread": 2, "b": "cpu", "c": True}
    assert set(figures_over_rounds([{"a": 1, "z": 2}], keys=("z",))) == {"z", "z_by_round", "z_spread"}
