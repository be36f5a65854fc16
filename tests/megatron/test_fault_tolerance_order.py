"""The engine's waits ordered below nvidia-resiliency-ext's rank monitor (``megatron.fault_tolerance``).

What the functions decide from the monitor's timeouts; Megatron-LM's own loop under ``ft_launcher``
is ``tests/megatron_lm/test_fault_tolerance.py``.
"""

from __future__ import annotations

import argparse

import pytest

from megatron_ext.engine.config import EngineConfig
from megatron_ext.megatron.fault_tolerance import SHARE, FtTimeouts, WaitBounds, order_engine_timeouts

MEGATRON_DOCS = FtTimeouts({"setup": 600.0, "step": 180.0, "checkpointing": 420.0}, 300.0)


def flags(snapshot: float | None = None, persist: float | None = None) -> argparse.Namespace:
    return argparse.Namespace(datastates_snapshot_timeout_s=snapshot, datastates_persist_timeout_s=persist)


def test_defaults_are_lowered_to_their_share_of_the_shortest_section_they_fall_in():
    args = flags()
    assert order_engine_timeouts(args, MEGATRON_DOCS) == []
    assert args.datastates_snapshot_timeout_s == SHARE * 180  # step (the lazy wait), not out-of-section 300
    assert args.datastates_persist_timeout_s == SHARE * 420  # checkpointing, not setup 600


def test_the_out_of_section_timeout_bounds_the_lazy_wait_of_the_warm_up_steps():
    args = flags()
    order_engine_timeouts(args, FtTimeouts({"step": 180.0}, 60.0))
    assert args.datastates_snapshot_timeout_s == SHARE * 60
    assert args.datastates_persist_timeout_s is None  # no checkpointing or setup timeout: the engine's own


def test_defaults_below_the_monitor_stay_the_engines_and_sections_without_a_timeout_bound_nothing():
    args = flags()
    generous = FtTimeouts({"setup": None, "step": 3600.0, "checkpointing": 7200.0}, None)
    assert order_engine_timeouts(args, generous) == []
    assert (args.datastates_snapshot_timeout_s, args.datastates_persist_timeout_s) == (None, None)
    assert EngineConfig.snapshot_timeout_s < SHARE * 3600 and EngineConfig.persist_timeout_s < SHARE * 7200


def test_a_given_timeout_within_the_bound_is_kept():
    args = flags(snapshot=100.0, persist=300.0)
    assert order_engine_timeouts(args, MEGATRON_DOCS) == []
    assert (args.datastates_snapshot_timeout_s, args.datastates_persist_timeout_s) == (100.0, 300.0)


def test_a_given_timeout_above_the_bound_is_refused_naming_the_flag_the_section_and_the_limit():
    problems = order_engine_timeouts(flags(persist=1800.0), MEGATRON_DOCS)
    assert len(problems) == 1
    assert problems[0].startswith("--datastates-persist-timeout-s 1800 is longer than 80% of "
                                  "nvidia-resiliency-ext's checkpointing 420 s timeout (at most 336)")
    assert "lower --datastates-persist-timeout-s or raise that FT timeout" in problems[0]


def test_each_wait_takes_the_monitors_timeouts_again_when_they_shrink_during_the_run():
    now = {"ft": MEGATRON_DOCS}
    bounds = WaitBounds(EngineConfig(host_cache_size=0.01, snapshot_timeout_s=100.0, persist_timeout_s=300.0),
                        lambda: now["ft"])
    assert (bounds.snapshot(), bounds.persist()) == (100.0, 300.0)
    now["ft"] = FtTimeouts({"setup": 600.0, "step": 20.0, "checkpointing": 420.0}, 300.0)  # --calc-ft-timeouts
    assert (bounds.snapshot(), bounds.persist()) == (SHARE * 20, 300.0)
    now["ft"] = None  # no monitor
    assert (bounds.snapshot(), bounds.persist()) == (100.0, 300.0)


@pytest.mark.parametrize("section", ["step", "checkpointing"])
def test_bound_names_the_section_it_comes_from(section):
    limit, where = FtTimeouts({section: 50.0}, None).bound(
        "snapshot_timeout_s" if section == "step" else "persist_timeout_s")
    assert (limit, where) == (SHARE * 50, f"{section} 50 s")
