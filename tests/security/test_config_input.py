"""Crafted configurations fail at construction with a ConfigError, on every construction path;
directories are checked for equality and nesting; telemetry is probed at start-up and its later
write failures never cost a checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, ConfigError, EngineConfig

from helpers.hostile import SMALL


@pytest.mark.parametrize("values, message", [
    ({"pickle_fallback": "false"}, "pickle_fallback must be true or false, got 'false'"),
    ({"remove_partial_on_start": 0}, "remove_partial_on_start must be true or false, got 0"),
    ({"peer_replica": "no"}, "peer_replica must be true or false"),
    ({"o_direct": 1}, 'o_direct must be true, false or "auto", got 1'),
    ({"save_dir": 7}, "save_dir must be a path (a non-empty string), got 7"),
    ({"local_dir": ""}, "local_dir must be a path"),
    ({"telemetry_path": ["x"]}, "telemetry_path must be a path"),
    ({"save_dir": "a\0b"}, "save_dir must be a path"),
    ({"save_dir": "gs://bucket/run1"}, "save_dir 'gs://bucket/run1' is a gs:// URL; the object-store level takes s3://"),
    ({"save_dir": "s3://"}, "save_dir: 's3://': no valid bucket name after s3://"),
    ({"save_dir": "s3://bucket/a/../b"}, "may not hold empty, '.' or '..' parts"),
    ({"local_dir": "s3://bucket/x"}, "local_dir 's3://bucket/x' is a s3:// URL; it must be a POSIX path"),
    ({"save_dir": "s3://bucket/x", "peer_replica": True}, "peer_replica is not available with an object-store save_dir"),
    ({"local_dir": "msc://profile/x"}, "local_dir 'msc://profile/x' is a msc:// URL"),
    ({"host_cache_size": 1e308}, "host_cache_size 1e+308 GiB is absurd"),
    ({"host_cache_size": 2 ** 70}, "is absurd"),
    ({"persist_timeout_s": 1e308}, "persist_timeout_s must be at most"),
    ({"snapshot_timeout_s": float("inf")}, "snapshot_timeout_s must be a finite number"),
    ({"restore_threads": 4.0}, "restore_threads must be a whole number in [1, 64], got 4.0"),
    ({"keep_last": "3"}, "keep_last must be a whole number >= 1, got '3'"),
    ({"on_failure": ["stop"]}, "on_failure must be one of ['stop', 'continue'], got ['stop']"),
    ({"parser_threads": "8"}, "parser_threads must be a whole number"),
    ({"telemetry_path": "/tmp/{user}.jsonl"}, "only {rank} may be substituted"),
], ids=lambda v: repr(v)[:40] if isinstance(v, dict) else None)
def test_every_construction_path_rejects(values, message):
    for build in (lambda: EngineConfig(**values), lambda: EngineConfig.from_dict(values, probe=False),
                  lambda: dataclasses.replace(EngineConfig(), **values), lambda: CheckpointEngine(values)):
        with pytest.raises(ConfigError) as info:
            build()
        assert message in str(info.value)


@pytest.mark.parametrize("values, message", [
    ({"safe_classes": ["os.system"]}, "safe class 'os.system' is not a class defined under that exact name"),
    ({"host_cache_size": 1e6}, "host_cache_size 1000000.0 GiB exceeds 90% of this node's"),
], ids=lambda v: repr(v)[:40] if isinstance(v, dict) else None)
def test_every_start_up_path_checks_the_node(values, message):
    """Constructing reads nothing; every path to a running engine runs ``check_node`` (imports, memory)."""
    config = EngineConfig(**values)  # the values alone are fine
    for build in (config.check_node, lambda: EngineConfig.from_dict(values, probe=False),
                  lambda: CheckpointEngine(values), lambda: CheckpointEngine(config)):
        with pytest.raises(ConfigError) as info:
            build()
        assert message in str(info.value)


def test_levels_must_be_apart(tmp_path):
    save = tmp_path / "save"
    with pytest.raises(ConfigError, match="save_dir and local_dir are the same directory"):
        EngineConfig(save_dir=str(save), local_dir=str(save) + "/")
    os.makedirs(save)
    os.symlink(save, tmp_path / "alias")
    with pytest.raises(ConfigError, match="save_dir and local_dir are the same directory"):
        EngineConfig(save_dir=str(save), local_dir=str(tmp_path / "alias"))
    with pytest.raises(ConfigError, match="local_dir lies inside save_dir"):
        EngineConfig(save_dir=str(save), local_dir=str(save / "local"))
    with pytest.raises(ConfigError, match="save_dir lies inside local_dir"):
        EngineConfig(save_dir=str(tmp_path / "l" / "save"), local_dir=str(tmp_path / "l"))
    with pytest.raises(ConfigError, match="replica_dir lies inside save_dir"):
        EngineConfig(save_dir=str(save), peer_replica=True, replica_dir=str(save / "r"))
    EngineConfig(save_dir=str(save), local_dir=str(tmp_path / "save_local"))  # a common prefix is fine


def test_unwritable_telemetry_path_fails_at_start_up(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file")
    with pytest.raises(ConfigError, match="telemetry_path directory .* is not a writable directory"):
        CheckpointEngine({"save_dir": str(tmp_path / "save"), **SMALL,
                          "telemetry_path": str(blocker / "t" / "rank-{rank}.jsonl")})
    (tmp_path / "tele").mkdir()
    os.mkdir(tmp_path / "tele" / "rank-0.jsonl")  # a directory where the file should go
    with pytest.raises(ConfigError, match="exists and is not a writable file"):
        CheckpointEngine({"save_dir": str(tmp_path / "save"), **SMALL,
                          "telemetry_path": str(tmp_path / "tele" / "rank-{rank}.jsonl")})


def test_telemetry_write_failure_is_logged_not_fatal(tmp_path, caplog):
    telemetry = tmp_path / "tele" / "rank-0.jsonl"
    with CheckpointEngine({"save_dir": str(tmp_path / "save"), **SMALL, "telemetry_path": str(telemetry)}) as engine:
        engine.save({"w": torch.ones(4)}, "c1", version=1)
        engine.commit("c1")
        engine.wait_persisted()
        assert telemetry.read_text().count("\n") >= 1
        telemetry.unlink()
        telemetry.mkdir()  # from now on every telemetry write fails
        with caplog.at_level(logging.WARNING, logger="megatron_ext.engine"):
            for i in (2, 3):
                engine.save({"w": torch.ones(4) * i}, f"c{i}", version=i)
                engine.commit(f"c{i}")
                engine.wait_persisted()
        assert engine.telemetry.write_errors >= 2
        assert caplog.text.count("cannot write telemetry") == 1  # said once, then counted
        assert torch.equal(engine.load("c3")["w"], torch.ones(4) * 3)
