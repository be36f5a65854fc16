"""SIGKILL and resume in Megatron-LM's own loop with the checkpoints on an object store (``--save s3://...``).

2 CPU ranks train the tiny Llama-style GPT with ``--use-datastates --save-interval 1``, ``--save`` and
``--load`` one ``s3://bucket/prefix`` (``s3_root``: a bucket of its own on the session's S3 server; the
ranks inherit the AWS_* environment the fixture sets) and keep-last-2 retention, so the object-store level
runs under Megatron-LM: multipart uploads, commits whose manifest object goes last, the tracker object,
retention's deletes, and at the restart the listing, the tracker's GET and the reads of fetched objects.

The job's training thread stops in its 4th save (the engine's ``after_save`` stop point; the flushes and
commits of the earlier checkpoints go on in the background) and the whole job is SIGKILLed once the tracker
object names iteration 2 or later, so the crash always leaves a committed checkpoint on the store and newer
ones in flight. Then:

* every committed checkpoint under the URL verifies (``megatron-ext verify s3://...``);
* the restart resumes from the tracker's checkpoint, and its steps, with the killed run's, are bit for bit
  those of an uninterrupted run saving to a file system (loss, grad norm, learning rate, ...), the
  iterations it repeats included;
* the last checkpoint on the store holds, bit for bit, the uninterrupted run's last checkpoint: every
  model and optimizer tensor.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers.megatron_lm_runs import DATASTATES, RunResult, assert_same_trajectory, run, trajectory
from helpers.procs import child_env, kill_job, python_command, warm_command
from megatron_ext.engine.faults import STOP_DIR_ENV, STOP_ENV
from megatron_ext.engine.format.catalog import list_committed
from megatron_ext.megatron.checkpoint_layout import read_tracker
from megatron_ext.testing import megatron_lm

ITERS = 6
NPROC = 2
STOP_AT_SAVE = 4  # the training thread stops in this iteration's save
COMMITTED_BEFORE_KILL = 2  # the kill waits until the tracker names this iteration or a later one
KILL_TIMEOUT_S = 300
COMMON = ["--bf16", "--use-distributed-optimizer", "--save-interval", "1", "--train-iters", str(ITERS),
          *megatron_lm.LLAMA_STYLE, *DATASTATES, "--datastates-keep-last", "2"]


def _killed(checkout: Path, tmp: Path, args: list[str], url: str) -> tuple[RunResult, int]:
    """The job, every rank's training thread stopped in save ``STOP_AT_SAVE``, SIGKILLed whole once the tracker
    object names ``COMMITTED_BEFORE_KILL`` or later; (its recorded steps, the tracker's iteration at the kill)."""
    markers, record, log_path = tmp / "markers", tmp / "killed.jsonl", tmp / "killed.log"
    markers.mkdir(parents=True)
    cmd = warm_command(megatron_lm.torchrun_command(NPROC, [*megatron_lm.TINY_GPT, *args], checkout,
                                                    record=str(record)))
    env = dict(megatron_lm.environment(), **{STOP_ENV: f"after_save@{STOP_AT_SAVE}", STOP_DIR_ENV: str(markers)})
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + KILL_TIMEOUT_S
            while True:
                tracked = read_tracker(url)
                stopped = len(list(markers.iterdir()))  # every rank's training thread, its step recorded
                if stopped == NPROC and isinstance(tracked, int) and tracked >= COMMITTED_BEFORE_KILL:
                    break
                if proc.poll() is not None:
                    pytest.fail(f"the job ended (exit code {proc.returncode}) before the kill (tracker: {tracked})"
                                f"\n{log_path.read_text(errors='replace')[-4000:]}")
                assert time.monotonic() < deadline, (f"{stopped} of {NPROC} ranks stopped, tracker {tracked}, "
                                                     f"after {KILL_TIMEOUT_S}s")
                time.sleep(0.1)
        finally:
            kill_job(proc)
    tracked = read_tracker(url)  # a commit may have landed between the check and the kill
    return RunResult(megatron_lm.read_records(record), log_path.read_text(errors="replace"), -9), tracked


def _verify(url: str) -> None:
    proc = subprocess.run(python_command("-m", "megatron_ext", "verify", url), capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert proc.returncode == 0, f"a committed checkpoint under {url} does not verify:\n{proc.stdout}\n{proc.stderr}"


def _saved_tensors(root: str, iteration: int) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``iteration`` under ``root`` (a path or a URL), whole."""
    from megatron_ext.megatron.export import open_iteration
    from megatron_ext.megatron.shard_assembly import SavedShards

    shards = SavedShards(open_iteration(root, iteration))
    return {key: shards.read_global(key) for key in shards.keys()}


def test_sigkill_resume_on_an_object_store_is_bit_exact(checkout, tmp_path, s3_root):
    started = time.monotonic()
    url = s3_root
    on_store = [*COMMON, "--save", url, "--load", url]
    reference_dir = tmp_path / "reference" / "ckpt"
    reference = run(checkout, NPROC, [*COMMON, "--save", str(reference_dir), "--load", str(reference_dir)],
                    tmp_path / "reference", "uninterrupted")
    assert list(trajectory(reference)) == list(range(1, ITERS + 1))

    killed, committed_at_kill = _killed(checkout, tmp_path, on_store, url)
    assert [r["iteration"] for r in killed.records] == list(range(1, STOP_AT_SAVE + 1)), killed.records
    assert COMMITTED_BEFORE_KILL <= committed_at_kill <= STOP_AT_SAVE
    assert f"iter_{committed_at_kill:07d}" in [name for name, _ in list_committed(url)]
    _verify(url)

    resumed = run(checkout, NPROC, on_store, tmp_path, "resumed")
    assert resumed.first_iteration == committed_at_kill + 1, resumed.first_iteration
    assert f"loaded iter_{committed_at_kill:07d} from {url} (shared level)" in resumed.log
    assert_same_trajectory(trajectory(killed, resumed), trajectory(reference),
                           "killed + resumed on s3 vs uninterrupted")
    assert read_tracker(url) == ITERS
    assert [name for name, _ in list_committed(url)] == [f"iter_{ITERS - 1:07d}", f"iter_{ITERS:07d}"]

    theirs, ours = _saved_tensors(str(reference_dir), ITERS), _saved_tensors(url, ITERS)
    assert sorted(ours) == sorted(theirs)
    different = [key for key in ours if not torch.equal(ours[key], theirs[key])]
    assert not different, f"iteration {ITERS} on s3 differs from the uninterrupted run's in {different}"
    print(f"resumed from iteration {committed_at_kill} on {url}; {len(ours)} tensors equal; "
          f"{time.monotonic() - started:.1f}s")
