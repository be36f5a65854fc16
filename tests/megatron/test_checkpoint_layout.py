"""The Megatron checkpoint layout's names, tracker and parts, and the adapter's own options."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, open_committed
from megatron_ext.engine.errors import ConfigError
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


def test_file_of_rank(tmp_path):
    with CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.01}, rank=0, world_size=1) as engine:
        engine.save({"w": torch.ones(4)}, "c1", "rank00000")
        engine.commit("c1")
        engine.wait_persisted()
    committed = open_committed(str(tmp_path), "c1")
    assert layout.file_of_rank(committed, 0) == "rank00000"
    assert layout.file_of_rank(committed, 1) is None


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



def test_graph_safe_tracker_generators_saved_as_states_and_restored_in_place(tmp_path):
    """CUDA graphs and --te-rng-tracker keep torch.Generator objects in the RNG tracker (issue 26).

    The saved state holds state tensors (the sidecar cannot hold a Generator), captured at the save
    (a generator advances in place); the load puts them back into the tracker's own generators.
    Here the generators are CPU ones; on a GPU they are CUDA generators (tests/gpu).
    """
    from megatron.core import tensor_parallel

    from helpers.states import through_a_checkpoint

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved_states = tracker.get_states()
    generators = {"model-parallel-rng": torch.Generator().manual_seed(3), "expert-parallel-rng": torch.Generator()}
    generators["expert-parallel-rng"].manual_seed(5)
    tracker.set_states(dict(generators))
    try:
        captured = layout.capture_rng_state()
        assert all(isinstance(v, torch.Tensor) for v in captured["tracker"].values())
        expected = {name: torch.rand(4, generator=g) for name, g in generators.items()}  # draws after the save
        loaded = through_a_checkpoint(tmp_path, {"rng": captured})["rng"]
        layout.restore_rng_state(loaded)
        after = tracker.get_states()
        assert all(after[name] is generators[name] for name in generators)  # the same objects, set in place
        for name, g in generators.items():
            assert torch.equal(torch.rand(4, generator=g), expected[name])
    finally:
        tracker.set_states(saved_states)
