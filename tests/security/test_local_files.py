"""Files the engine itself keeps outside checkpoints cannot be turned against it: the lock file, the
telemetry file and the peer replicas in host memory.

* ``.datastates.lock`` with a second hard link (to a file outside) or another owner is refused at
  start-up, and the file it links to is left as it was (symbolic links were refused already).
* ``telemetry_path`` is probed by a real write at start-up, so a place that accepts no files
  (``/proc``, where root's ``os.access`` says yes) fails there, not silently later.
* Peer replicas live under a per-user directory, created 0700; a directory someone else made
  first, one open to others, or a symbolic link anywhere on the way is refused, at start-up and at
  every later open.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from megatron_ext.engine import CheckpointEngine, CheckpointError, ConfigError, EngineConfig
from megatron_ext.engine.files import private_dir
from megatron_ext.engine.save.lifecycle import lock as dir_lock
from megatron_ext.engine.save.replicas.replica import default_replica_dir
from megatron_ext.engine.save.replicas.replica_store import ReplicaStore

from helpers.hostile import SMALL

OTHER_UID = 4242
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")


# ------------------------------------------------------------------------------ the lock file
def test_a_hard_linked_lock_file_is_refused_and_left_alone(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    os.link(outside, save / dir_lock.LOCK_FILE)
    with pytest.raises(CheckpointError, match=re.escape(f"{save / dir_lock.LOCK_FILE}: has 2 links")):
        CheckpointEngine({"save_dir": str(save), **SMALL})
    assert outside.read_text() == "keep me"
    assert dir_lock.runs_of(str(save)) == []  # nor is its content taken for the lock's history


@as_root
def test_a_lock_file_of_another_user_is_refused(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    lock = save / dir_lock.LOCK_FILE
    lock.write_text('{"runs": ["0123456789ab"]}')
    os.chown(lock, OTHER_UID, -1)
    with pytest.raises(CheckpointError, match=re.escape(f"{lock}: owned by user {OTHER_UID}")):
        CheckpointEngine({"save_dir": str(save), **SMALL})
    assert lock.read_text() == '{"runs": ["0123456789ab"]}'
    os.chown(lock, os.geteuid(), -1)
    CheckpointEngine({"save_dir": str(save), **SMALL}).shutdown()  # ours again: taken as usual


# ------------------------------------------------------------------------------ telemetry
@pytest.mark.parametrize("path", ["/proc/datastates-telemetry/rank-{rank}.jsonl", "/proc/rank-{rank}.jsonl"])
def test_telemetry_that_cannot_be_written_fails_at_start_up(tmp_path, path):
    with pytest.raises(ConfigError, match="telemetry_path"):
        CheckpointEngine({"save_dir": str(tmp_path / "save"), **SMALL, "telemetry_path": path})


def test_the_telemetry_probe_leaves_nothing_behind(tmp_path):
    (tmp_path / "tele").mkdir()
    telemetry = tmp_path / "tele" / "rank-0.jsonl"
    EngineConfig(save_dir=str(tmp_path / "save"), telemetry_path=str(telemetry)).validate(0)
    assert list((tmp_path / "tele").iterdir()) == []  # the probe's own file is gone
    telemetry.write_text('{"event": "commit"}\n')
    EngineConfig(save_dir=str(tmp_path / "save"), telemetry_path=str(telemetry)).validate(0)
    assert telemetry.read_text() == '{"event": "commit"}\n'  # an existing file is opened, not written


# ------------------------------------------------------------------------------ peer replicas
def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_replica_directory_is_per_user():
    path = default_replica_dir("/lustre/run1/ckpt")
    assert os.path.dirname(path) == os.path.join(os.path.realpath("/dev/shm"), f"megatron_ext-{os.geteuid()}")
    assert path != default_replica_dir("/lustre/run2/ckpt")


def test_a_private_directory_is_created_0700(tmp_path):
    made = private_dir(str(tmp_path / "r" / "node-00000"), "replica_dir")
    assert made == str(tmp_path / "r" / "node-00000")
    for path in (tmp_path / "r", tmp_path / "r" / "node-00000"):
        assert _mode(path) == 0o700 and os.lstat(path).st_uid == os.geteuid()


def test_a_symbolic_link_in_place_of_the_replica_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "r").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="a symbolic link"):
        private_dir(str(tmp_path / "r" / "node-00000"), "replica_dir")
    assert list(elsewhere.iterdir()) == []


def test_a_replica_directory_open_to_others_is_refused(tmp_path):
    (tmp_path / "r").mkdir(mode=0o755)
    os.chmod(tmp_path / "r", 0o755)
    with pytest.raises(CheckpointError, match="open to other users"):
        private_dir(str(tmp_path / "r"), "replica_dir")


@as_root
def test_a_replica_directory_another_user_made_first_is_refused(tmp_path):
    (tmp_path / "r").mkdir(mode=0o700)
    os.chown(tmp_path / "r", OTHER_UID, -1)
    with pytest.raises(CheckpointError, match=f"owned by user {OTHER_UID}"):
        private_dir(str(tmp_path / "r" / "node-00000"), "replica_dir")


def test_every_open_of_a_replica_checks_the_path_again(tmp_path):
    """A symbolic link planted after start-up (where the holder keeps a source's replicas) is refused
    before anything is written through it."""
    node = private_dir(str(tmp_path / "r" / "node-00000"), "replica_dir")
    store = ReplicaStore(node, source=1)
    store.begin()
    os.rename(store.base, str(tmp_path / "moved"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, store.base)
    with pytest.raises(CheckpointError, match="a symbolic link"):
        store.begin()
    with pytest.raises(CheckpointError, match="a symbolic link"):
        store.held("iter_0000001")
    assert list(elsewhere.iterdir()) == []


def test_the_replica_directory_is_created_private_at_start_up(tmp_path):
    replica = tmp_path / "replicas"
    EngineConfig(save_dir=str(tmp_path / "save"), peer_replica=True, ranks_per_node=1,
                 replica_dir=str(replica)).validate(0)
    assert _mode(replica) == 0o700

