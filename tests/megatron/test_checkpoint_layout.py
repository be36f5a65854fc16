"""The Megatron checkpoint layout's names, tracker and parts, and the adapter's own options."""

from __future__ import annotations

import argparse

import pytest

from megatron_ext.engine import CheckpointError
from megatron_ext.engine.config import ConfigError
from megatron_ext.megatron import checkpoint_layout as layout
from megatron_ext.megatron.args import MegatronAdapterOptions


def test_names_are_megatrons():
    assert layout.checkpoint_name(123) == "iter_0000123"
    assert layout.checkpoint_name(layout.RELEASE) == "release"
    assert layout.checkpoint_dir("/s", 5) == "/s/iter_0000005"
    assert layout.rank_file_name(3) == "rank00003"
    assert layout.TRACKER_FILE == "latest_checkpointed_iteration.txt"


def test_tracker_round_trip(tmp_path):
    assert layout.read_tracker(str(tmp_path)) is None
    layout.write_tracker(str(tmp_path), 42)
    assert (tmp_path / layout.TRACKER_FILE).read_text() == "42"
    assert layout.read_tracker(str(tmp_path)) == 42
    layout.write_tracker(str(tmp_path), layout.RELEASE)
    assert layout.read_tracker(str(tmp_path)) == layout.RELEASE
    (tmp_path / layout.TRACKER_FILE).write_text("nonsense")
    with pytest.raises(CheckpointError, match="not an iteration number"):
        layout.read_tracker(str(tmp_path))


def test_tracker_written_by_rank_zero_only(tmp_path):
    layout.tracker_writer(str(tmp_path), 7, rank=1)({"files": {}})
    assert layout.read_tracker(str(tmp_path)) is None
    layout.tracker_writer(str(tmp_path), 7, rank=0)({"files": {}})
    assert layout.read_tracker(str(tmp_path)) == 7


def test_rank_state_parts_in_order():
    shards = {"tensors": {}, "objects": {}, "meta": {}}
    assert list(layout.rank_state(shards)) == ["shards"]
    state = layout.rank_state(shards, rng={"r": 1}, rerun_state=None, common={}, meta={"iteration": 1})
    assert list(state) == ["shards", "rng", "common", "meta"]
    assert layout.rank_extra({"b", "a"}, {"tp": 1}) == {"objects": ["a", "b"], "layout": {"tp": 1}}


def test_file_of_rank():
    manifest = {"files": {"rank00000": {"rank": 0}, "rank00001": {"rank": 1}}}
    assert layout.file_of_rank(manifest, 1) == "rank00001"
    assert layout.file_of_rank(manifest, 2) is None


def test_storable_args_keeps_plain_values_and_reprs_others():
    class Opaque:
        def __repr__(self) -> str:
            return "Opaque()"

    stored = layout.storable_args(argparse.Namespace(lr=0.1, name="gpt", odd=Opaque()))
    assert (stored.lr, stored.name, stored.odd) == (0.1, "gpt", "Opaque()")


def test_megatron_lm_rng_names_round_trip():
    ours = {"random": 1, "numpy": 2, "torch": 3, "tracker": 4}
    theirs = {name: ours.get(key) for name, key in layout.MEGATRON_LM_RNG_NAMES.items()}
    assert layout.from_megatron_lm_rng([theirs]) == ours
    with pytest.raises(CheckpointError):
        layout.from_megatron_lm_rng({"random_rng_state": 1})


def test_adapter_options_from_args_and_validated():
    assert MegatronAdapterOptions.from_args(argparse.Namespace()) == MegatronAdapterOptions()
    options = MegatronAdapterOptions.from_args(argparse.Namespace(use_datastates=True, datastates_load_fallback=True))
    assert options.enabled and options.load_fallback
    with pytest.raises(ConfigError, match="load_fallback"):
        MegatronAdapterOptions(load_fallback="yes")

