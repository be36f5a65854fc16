"""One writing job per directory, with real processes: a second job is refused at start-up naming
the holder, a dead holder's lock is taken over, only the holder removes anything, loading removes
nothing."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError, list_committed
from megatron_ext.engine.save.lifecycle import lock as dir_lock

from helpers.hostile import SMALL
from helpers.procs import REPO, child_env, torchrun_command

WORKER = Path(__file__).with_name("lock_worker.py")


def _start(mode: str, save: Path, local: Path | None, status: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), mode, str(save), str(local) if local else "-", str(status)],
                            env=child_env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _await(path: Path, proc: subprocess.Popen | None = None, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _partial(save: Path, name: str = "iter_0000009") -> Path:
    """What a crashed run leaves: a rank report, no manifest."""
    path = save / name / ".reports"
    path.mkdir(parents=True)
    (path / "rank-00000.0123456789ab.json").write_text("{}")
    return save / name


@pytest.mark.multiproc
def test_second_job_is_refused_naming_the_holder_and_removes_nothing(tmp_path):
    """The holder is another process; this test process plays the second job."""
    save, local = tmp_path / "save", tmp_path / "local"
    holder = _start("hold", save, local, tmp_path / "holder")
    try:
        held = _await(tmp_path / "holder", holder)
        partial = _partial(save)
        named = rf"run {held['run_id']} \(host {re.escape(socket.gethostname())}, pid {held['pid']}, since "
        # Same save_dir: refused at start-up, naming the holder's run, host and pid.
        with pytest.raises(dir_lock.LockedError, match=rf"save_dir {re.escape(str(save))} is in use by another job: {named}"):
            CheckpointEngine({"save_dir": str(save), **SMALL})
        # Another save_dir, same node-local directory: refused too, and its own save_dir lock released.
        with pytest.raises(dir_lock.LockedError, match=rf"local_dir {re.escape(str(local))} is in use by another job: {named}"):
            CheckpointEngine({"save_dir": str(tmp_path / "save3"), "local_dir": str(local), **SMALL})
        CheckpointEngine({"save_dir": str(tmp_path / "save3"), **SMALL}).shutdown()
        assert partial.exists()  # the refused jobs removed nothing
        # Loading beside the writer: allowed, takes no lock, removes nothing.
        with CheckpointEngine({"save_dir": str(save), **SMALL}, read_only=True) as reader:
            assert torch.equal(reader.load("iter_0000001")["w"], torch.arange(1000.0))
        assert partial.exists()
        (tmp_path / "holder.go").touch()
        _, err = holder.communicate(timeout=120)
        assert holder.returncode == 0, err[-3000:]
    finally:
        if holder.poll() is None:
            holder.kill()
    assert [n for n, _ in list_committed(str(save))] == ["iter_0000001", "iter_0000002"]
    lock = json.loads((save / dir_lock.LOCK_FILE).read_text())
    assert "pid" not in lock and lock["runs"] == [held["run_id"]]  # released: no holder, the run remembered
    # The holder ended cleanly: the next job starts, and as holder removes the crashed partial.
    with CheckpointEngine({"save_dir": str(save), "local_dir": str(local), **SMALL}) as after:
        after.save({"w": torch.ones(2)}, "iter_0000003", version=3)
        after.commit("iter_0000003")
    assert not partial.exists()
    assert [n for n, _ in list_committed(str(save))] == ["iter_0000001", "iter_0000002", "iter_0000003"]


@pytest.mark.multiproc
def test_lock_of_a_killed_job_is_taken_over(tmp_path, caplog):
    save = tmp_path / "save"
    crashed = _start("crash", save, None, tmp_path / "crashed")
    try:
        held = _await(tmp_path / "crashed", crashed)
    finally:
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(30)
    assert (save / "iter_0000002" / ".reports").is_dir() and not (save / "iter_0000002" / "manifest.json").exists()
    assert json.loads((save / dir_lock.LOCK_FILE).read_text())["pid"] == held["pid"]  # the dead holder's record
    with caplog.at_level("WARNING", logger="megatron_ext.engine"):
        engine = CheckpointEngine({"save_dir": str(save), **SMALL})
    try:
        assert f"took over the lock of run {held['run_id']} (host {socket.gethostname()}, pid {held['pid']}" in caplog.text
        assert not (save / "iter_0000002").exists()  # the crashed attempt, removed by the new holder
        assert torch.equal(engine.load("iter_0000001", "rank0")["w"], torch.arange(1000.0))
        engine.save({"w": torch.ones(3)}, "iter_0000003", version=3)
        engine.commit("iter_0000003")
        engine.wait_persisted()
    finally:
        engine.shutdown()
    assert [n for n, _ in list_committed(str(save))] == ["iter_0000001", "iter_0000003"]
    assert json.loads((save / dir_lock.LOCK_FILE).read_text())["runs"] == [held["run_id"], engine.run_id]


@pytest.mark.multiproc
def test_every_rank_of_a_refused_job_stops_with_the_holder_named(tmp_path):
    """One writer per directory means one *job*: two torchrun ranks share save_dir and local_dir;
    when another job holds save_dir, both ranks fail at start-up with the holder's name."""
    save, local = tmp_path / "save", tmp_path / "local"
    job = torchrun_command(2, str(WORKER), "try", str(save), str(local), str(tmp_path / "job"))
    ok = subprocess.run(job, env=child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stderr[-3000:]
    first = [json.loads((tmp_path / f"job.{r}").read_text()) for r in (0, 1)]
    assert all(r["ok"] for r in first) and first[0]["run_id"] == first[1]["run_id"]
    with CheckpointEngine({"save_dir": str(save), **SMALL}) as holder:
        refused = subprocess.run(job[:-1] + [str(tmp_path / "refused")], env=child_env(), cwd=str(REPO),
                                 capture_output=True, text=True, timeout=240)
        assert refused.returncode == 0, refused.stderr[-3000:]
        rank0, rank1 = (json.loads((tmp_path / f"refused.{r}").read_text()) for r in (0, 1))
        assert not rank0["ok"] and f"is in use by another job: run {holder.run_id}" in rank0["error"]
        assert not rank1["ok"] and rank1["error"].startswith("rank 0 could not start: save_dir")
        assert holder.run_id in rank1["error"]


def test_without_flock_nothing_is_removed(tmp_path, monkeypatch, caplog):
    """A file system that refuses flock (Lustre mounted noflock): a warning, and no removal at all."""
    save = tmp_path / "save"
    partial = _partial(save)

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(dir_lock.fcntl, "flock", no_flock)
    with caplog.at_level("WARNING", logger="megatron_ext.engine"):
        engine = CheckpointEngine({"save_dir": str(save), **SMALL, "keep_last": 1})
    try:
        assert "does not support flock" in caplog.text and "nothing will be removed" in caplog.text
        for i in (1, 2, 3):
            engine.save({"w": torch.ones(3) * i}, f"iter_000000{i}", version=i)
            engine.commit(f"iter_000000{i}")
            engine.wait_persisted()
    finally:
        engine.shutdown()
    assert partial.exists()
    assert [n for n, _ in list_committed(str(save))] == ["iter_0000001", "iter_0000002", "iter_0000003"]


def test_a_second_engine_in_the_same_process_is_refused(tmp_path):
    with CheckpointEngine({"save_dir": str(tmp_path), **SMALL}) as first:
        with pytest.raises(dir_lock.LockedError, match=f"run {first.run_id} .*pid {os.getpid()}"):
            CheckpointEngine({"save_dir": str(tmp_path), **SMALL})
        with CheckpointEngine({"save_dir": str(tmp_path), **SMALL}, read_only=True) as reader:
            with pytest.raises(CheckpointError, match="opened read_only: it loads, it does not save"):
                reader.save({"w": torch.ones(1)}, "x")
    # Released at shutdown: the next engine starts.
    CheckpointEngine({"save_dir": str(tmp_path), **SMALL}).shutdown()


def test_a_sibling_rank_waits_for_its_run_to_show_up_in_a_stale_lock_file(tmp_path, monkeypatch):
    """After a crash the lock file still names the dead run; a rank whose sibling has just taken the
    lock (and not yet written its name) must wait for its own run id, not take the stale name.

    The sibling writes its name only once the rank has read the stale one (a spy on the lock
    module's own reader), so the rank is seen waiting on every run, however the threads are scheduled.
    """
    import fcntl
    import threading

    local = tmp_path / "local"
    local.mkdir()
    run_id = "abcdefabcdef"
    path = local / dir_lock.LOCK_FILE
    path.write_text(json.dumps({"host": "gone", "pid": 1, "run_id": "deaddeaddead", "since": 0, "runs": ["deaddeaddead"]}))
    sibling = os.open(path, os.O_RDWR)
    fcntl.flock(sibling, fcntl.LOCK_EX)  # the sibling holds the lock, its name not written yet
    read_stale = threading.Event()
    real_read = dir_lock._read

    def spying_read(fd):
        record = real_read(fd)
        if record.get("run_id") == "deaddeaddead":
            read_stale.set()
        return record

    monkeypatch.setattr(dir_lock, "_read", spying_read)

    def write_name_once_the_rank_waits():
        if read_stale.wait(60):  # never set: the rank did not wait, and fails on its own
            os.pwrite(sibling, json.dumps({"run_id": run_id, "runs": ["deaddeaddead", run_id]}).encode().ljust(200), 0)

    writer = threading.Thread(target=write_name_once_the_rank_waits)
    writer.start()
    try:
        with CheckpointEngine({"save_dir": str(tmp_path / "save"), "local_dir": str(local), **SMALL},
                              rank=1, world_size=2, run_id=run_id, commit_store=dist.HashStore()) as engine:
            assert read_stale.is_set()  # it saw the dead run's name first, and waited past it
            assert engine.local_lock.state == "shared"
            assert engine.local_lock.runs == ["deaddeaddead", run_id]
    finally:
        read_stale.set()  # release the writer whatever happened
        writer.join(60)
        os.close(sibling)


def test_a_forked_child_does_not_keep_the_lock_after_the_engine_releases_it(tmp_path):
    """DataLoader workers fork while the engine holds its lock; Megatron-LM shuts the engine down after
    training and saves once more with a new one, in the same process, with the workers still alive.

    The child says it is up over a pipe (its at-fork handler has run by then) and stays alive until
    the parent closes the other pipe: no sleep decides the order."""
    import select

    from megatron_ext.engine.save.lifecycle import lock as dir_lock

    first = dir_lock.acquire(str(tmp_path), "aaaaaaaaaaaa", "save_dir")
    up_r, up_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that outlives the engine
        try:
            os.close(up_r)
            os.close(done_w)
            os.write(up_w, b"up")
            select.select([done_r], [], [], 60)  # until the parent is done (end of file), at most 60 s
        finally:
            os._exit(0)
    os.close(up_w)
    os.close(done_r)
    try:
        ready, _, _ = select.select([up_r], [], [], 60)
        assert ready and os.read(up_r, 2) == b"up", "the forked child never started"
        first.release()
        again = dir_lock.acquire(str(tmp_path), "bbbbbbbbbbbb", "save_dir")
        assert again.held
        assert os.waitpid(child, os.WNOHANG) == (0, 0)  # the child was alive all along
        again.release()
    finally:
        os.close(done_w)
        os.close(up_r)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
