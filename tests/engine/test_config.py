"""Bad configurations fail at construction with a ConfigError that says what is wrong."""

from __future__ import annotations

import os

import pytest

from megatron_ext.engine import CheckpointEngine, ConfigError, EngineConfig


@pytest.mark.parametrize("section, message", [
    ({"host_cache_sise": 1.0}, r"unknown datastates_ckpt key\(s\) \['host_cache_sise'\]"),
    ({"foo": 1, "bar": 2}, r"unknown datastates_ckpt key\(s\) \['bar', 'foo'\]; known keys"),
    ({"host_cache_size": 0}, r"host_cache_size must be > 0 GiB, got 0"),
    ({"host_cache_size": -1.5}, r"host_cache_size must be > 0 GiB, got -1.5"),
    ({"host_cache_size": float("nan")}, r"host_cache_size must be a finite number"),
    ({"host_cache_size": 1e-9}, r"below the 16 KiB minimum"),
    ({"host_cache_size": 1e6}, r"host_cache_size 1000000.0 GiB exceeds 90% of this node's"),
    ({"host_cache_size": "1"}, r"host_cache_size must be a number, got '1'"),
    ({"host_cache_size": None}, r"host_cache_size must be a number, got None"),
    ({"host_cache_size": True}, r"host_cache_size must be a number, got True"),
    ({"host_cache_size": [1]}, r"host_cache_size must be a number"),
    ({"chunk_size_mb": 0}, r"chunk_size_mb must be in \(0, 4096\], got 0"),
    ({"chunk_size_mb": 5000}, r"chunk_size_mb must be in \(0, 4096\]"),
    ({"chunk_size_mb": "16"}, r"chunk_size_mb must be a number"),
    ({"o_direct": "yes"}, r"o_direct must be true, false or \"auto\", got 'yes'"),
    ({"o_direct": "true"}, r"o_direct must be true, false or \"auto\""),
    ({"o_direct": None}, r"o_direct must be true, false or \"auto\""),
    ({"on_failure": "ignore"}, r"on_failure must be one of \['stop', 'continue'\], got 'ignore'"),
    ({"keep_last": 0}, r"keep_last must be a whole number >= 1, got 0"),
    ({"keep_every": 2.5}, r"keep_every must be a whole number >= 1, got 2.5"),
    ({"keep_last": True}, r"keep_last must be a whole number >= 1, got True"),
    ({"snapshot_timeout_s": 0}, r"snapshot_timeout_s must be > 0 seconds, got 0"),
    ({"persist_timeout_s": -1}, r"persist_timeout_s must be > 0 seconds, got -1"),
    ({"persist_timeout_s": "60"}, r"persist_timeout_s must be a number"),
    ({"object_modules": ["deepspeed."]}, r"object_modules \(module prefixes\) was replaced by safe_classes"),
    ({"safe_classes": "collections.OrderedDict"}, r"safe_classes must be a list of class names"),
    ({"safe_classes": ["ok.Name", ""]}, r"safe_classes must be a list of class names"),
    ({"safe_classes": ["subprocess.os.system"]}, r"safe class 'subprocess.os.system' is not a class defined under"),
    ({"safe_classes": ["deepspeed.runtime.zero.config.subprocess.Popen"]}, r"is not a class defined under that exact"),
    ({"peer_replica": True, "overload_policy": "supersede"},
     r"peer_replica cannot be combined with overload_policy \"supersede\""),
], ids=lambda v: repr(v)[:40] if isinstance(v, dict) else None)
def test_bad_values_raise_config_error(section, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(section)
    with pytest.raises(ConfigError, match=message):
        CheckpointEngine(section, rank=0, world_size=1)


def test_infinite_host_cache_size_is_a_config_error():
    with pytest.raises(ConfigError, match="host_cache_size"):
        EngineConfig.from_dict({"host_cache_size": float("inf")})


def test_unwritable_directories(tmp_path):
    regular = tmp_path / "a_file"
    regular.write_text("not a directory")
    for key in ("save_dir", "local_dir"):
        with pytest.raises(ConfigError, match=rf"{key} '.*a_file/ckpt' is not writable"):
            EngineConfig.from_dict({key: str(regular / "ckpt")})
        with pytest.raises(ConfigError, match=rf"{key} '.*a_file' is not writable"):
            CheckpointEngine({key: str(regular)}, rank=0, world_size=1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="save_dir .* is not writable"):
            EngineConfig.from_dict({"save_dir": str(ro)})
    finally:
        ro.chmod(0o755)


def test_good_config_and_deepspeed_compat_keys(tmp_path):
    cfg = EngineConfig.from_dict({"host_cache_size": 0.5, "parser_threads": 8, "save_dir": str(tmp_path / "new"),
                                  "safe_classes": ["collections.Counter"], "o_direct": False})
    assert cfg.host_cache_bytes == 1 << 29 and cfg.safe_classes == ("collections.Counter",)
    assert (tmp_path / "new").is_dir()  # created, and proven writable
    assert not [p for p in (tmp_path / "new").iterdir()]  # the probe file is gone
    assert EngineConfig.from_dict(None) == EngineConfig()
    tiny = EngineConfig.from_dict({"host_cache_size": 0.0001, "chunk_size_mb": 0.004})
    assert tiny.chunk_bytes == 4096


def test_rank_outside_world_and_missing_root(tmp_path):
    with pytest.raises(ConfigError, match="rank 4 outside world of size 4"):
        CheckpointEngine({"host_cache_size": 0.001}, rank=4, world_size=4)
    with CheckpointEngine({"host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        with pytest.raises(ConfigError, match="no checkpoint directory"):
            engine.save({}, "c1")
        with pytest.raises(ConfigError, match="no checkpoint directory"):
            engine.latest()
