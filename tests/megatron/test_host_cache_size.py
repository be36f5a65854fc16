"""``--datastates-host-cache-size auto`` (the default): the rule, the flag, and the adapter's one log line."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from megatron_ext.engine.config import GIB, MIB
from megatron_ext.engine.errors import CheckpointError
from megatron_ext.megatron import host_cache_size as hcs
from megatron_ext.megatron.args import add_datastates_args, engine_config_from_args, validate_datastates_args

CHUNK = 16 * MIB


def _args(*argv: str) -> argparse.Namespace:
    parser = add_datastates_args(argparse.ArgumentParser())
    parser.add_argument("--save")
    return parser.parse_args(list(argv))


def test_the_cache_holds_the_rank_checkpoint_plus_one_chunk_within_the_bound():
    sizing = hcs.auto_host_cache(3 * GIB, {}, "test", mem_available=64 * GIB, local_ranks=4)
    assert sizing.chunk_bytes == CHUNK  # the engine's default chunk
    assert sizing.bound_bytes == 8 * GIB  # half of 64 GiB over 4 ranks
    assert sizing.nbytes == 3 * GIB + CHUNK
    assert sizing.gb == pytest.approx(3 + 1 / 64)


def test_the_bound_caps_a_checkpoint_too_large_for_this_nodes_memory():
    sizing = hcs.auto_host_cache(20 * GIB, {"chunk_size_mb": 4}, "test", mem_available=64 * GIB, local_ranks=8)
    assert sizing.chunk_bytes == 4 * MIB
    assert sizing.nbytes == sizing.bound_bytes == 4 * GIB


def test_without_memory_figures_no_bound_and_a_floor_for_empty_ranks():
    unknown = hcs.AutoCacheSize(rank_bytes=GIB, chunk_bytes=CHUNK, mem_available=None, local_ranks=1, source="x")
    assert unknown.bound_bytes is None and unknown.nbytes == GIB + CHUNK
    assert "no bound (available memory unknown)" in unknown.log_line()
    tiny = hcs.auto_host_cache(0, {"chunk_size_mb": 0.001}, "test", mem_available=GIB, local_ranks=1)
    assert tiny.nbytes == 16 << 10  # the engine's minimum


def test_the_log_line_says_how_the_size_was_chosen():
    line = hcs.auto_host_cache(3 * GIB, {}, "its first save, iteration 7", mem_available=64 * GIB,
                               local_ranks=4).log_line()
    assert line == ("[datastates] host cache auto: 3.02 GiB = this rank's checkpoint 3.00 GiB (its first save, "
                    "iteration 7) + one chunk 16.0 MiB; bound 8.00 GiB = 50% of MemAvailable 64.00 GiB / 4 rank(s) "
                    "on this node")
    capped = hcs.auto_host_cache(20 * GIB, {}, "x", mem_available=8 * GIB, local_ranks=1).log_line()
    assert capped.startswith("[datastates] host cache auto: 4.00 GiB = this rank's checkpoint 20.00 GiB")
    assert capped.endswith("(capped at the bound: saves larger than it wait for storage)")


def test_available_memory_and_local_ranks(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n")
    assert hcs.mem_available_bytes(str(meminfo)) == 8000000 * 1024
    assert hcs.mem_available_bytes(str(tmp_path / "missing")) > 0  # the physical memory instead
    assert hcs.local_world_size({"LOCAL_WORLD_SIZE": "8"}) == 8
    assert hcs.local_world_size({}) == hcs.local_world_size({"LOCAL_WORLD_SIZE": "x"}) == 1


def test_tensor_bytes_of_a_nested_state_counts_each_tensor_once():
    a = torch.zeros(10, dtype=torch.float32)
    state = {"x": [a, (torch.zeros(3, dtype=torch.bfloat16), a)], "y": {"z": torch.zeros(2, 2, dtype=torch.int64)},
             "meta": {"n": 3, "s": "text"}}
    assert hcs.tensor_bytes(state) == 40 + 6 + 32


def test_rank_bytes_of_a_loaded_checkpoint():
    manifest = {"world_size": 4, "files": {f"rank{r:05d}": {"rank": r, "size": 100 * (r + 1)} for r in range(4)}}
    assert hcs.checkpoint_rank_bytes(manifest, 2, 4) == 300  # the same world: its own file
    assert hcs.checkpoint_rank_bytes(manifest, 0, 2) == 800  # half the ranks: the largest rank's, twice
    assert hcs.checkpoint_rank_bytes(manifest, 0, 8) == 200


def test_auto_is_the_default_and_an_explicit_size_stays_a_number(tmp_path):
    save = str(tmp_path / "save")
    default = _args("--use-datastates", "--save", save)
    assert default.datastates_host_cache_size is None
    assert engine_config_from_args(default)["host_cache_size"] == "auto"
    validate_datastates_args(default)
    assert engine_config_from_args(_args("--save", save, "--datastates-host-cache-size", "auto"))[
        "host_cache_size"] == "auto"
    assert engine_config_from_args(_args("--save", save, "--datastates-host-cache-size", "0.05"))[
        "host_cache_size"] == 0.05
    with pytest.raises(SystemExit):
        _args("--datastates-host-cache-size", "lots")


def test_the_adapter_sizes_its_engine_and_logs_it_once(tmp_path, caplog, monkeypatch):
    from megatron_ext.megatron.checkpointing import MegatronCheckpointer

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = _args("--use-datastates", "--save", str(tmp_path / "save"), "--datastates-chunk-size-mb", "1")
    checkpointer = MegatronCheckpointer()
    with pytest.raises(CheckpointError, match="auto sizes the host cache from this rank's checkpoint bytes"):
        checkpointer.get_engine(args)
    with caplog.at_level(logging.INFO, logger="megatron_ext.megatron"):
        engine = checkpointer.get_engine(args, 5 * MIB, "its first save, iteration 1")
        assert checkpointer.get_engine(args) is engine  # fixed from then on: no bytes needed, no second line
    try:
        lines = [r.getMessage() for r in caplog.records if "host cache auto" in r.getMessage()]
        assert len(lines) == 1 and "this rank's checkpoint 5.0 MiB (its first save, iteration 1)" in lines[0]
        assert "/ 2 rank(s) on this node" in lines[0]
        assert engine.config.host_cache_bytes == 6 * MIB and engine.cache.nbytes == 6 * MIB
    finally:
        checkpointer.shutdown()
    explicit = MegatronCheckpointer()
    engine = explicit.get_engine(_args("--use-datastates", "--save", str(tmp_path / "other"),
                                       "--datastates-host-cache-size", "0.05"))
    try:
        assert engine.config.host_cache_size == 0.05
    finally:
        explicit.shutdown()
