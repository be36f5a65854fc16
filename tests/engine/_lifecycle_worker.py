"""Engines whose process ends abruptly, for test_commit.py and test_failures.py: each program is a
fresh interpreter that is SIGKILLed, or exits without shutting its engine down.

Usage: python _lifecycle_worker.py PROGRAM ROOT [commit|no-commit]

* ``killed-before-commit``: A committed; B's files durable but never committed; SIGKILL.
* ``killed-after-rank-report``: rank 0 of a 2-rank world commits P; its rank report lands, the
  manifest never can (rank 1 never reports); SIGKILL.
* ``exit-without-shutdown``: A committed; B saved (and committed or not); the interpreter exits
  with no wait and no shutdown.
* ``killed-mid-flush``: A committed; SIGKILL while B's third chunk is being written.

The states are the tests' ``_state`` (``helpers.states.seeded_state`` with the same arguments).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, faults

from helpers.states import TINY, seeded_state

#: The engine of ``exit-without-shutdown`` stays referenced until the interpreter exits.
_engine: CheckpointEngine | None = None


def _commit_state(i: int) -> dict:  # test_commit.py's _state
    return seeded_state(i, i=torch.arange(i, i + 50))


def _killed_before_commit(root: str) -> None:
    e = CheckpointEngine({"save_dir": root, **TINY})
    e.save(_commit_state(1), "A", version=1); e.commit("A"); e.wait_persisted()
    e.save(_commit_state(2), "B", version=2)
    e.wait_persisted("B")  # B's files are durable, but commit() was never called
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_after_rank_report(root: str) -> None:
    e = CheckpointEngine({"save_dir": root, **TINY}, rank=0, world_size=2, run_id="0123456789ab",
                         commit_store=dist.HashStore())  # rank 1 never comes
    e.save({"w": torch.ones(1000)}, "P", version=5); e.commit("P")
    report = os.path.join(root, "P", ".reports", "rank-00000.0123456789ab.json")
    deadline = time.monotonic() + 30
    while not os.path.exists(report):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_without_shutdown(root: str, commit: str) -> None:
    global _engine
    _engine = e = CheckpointEngine({"save_dir": root, **TINY})
    e.save(_commit_state(1), "A", version=1); e.commit("A"); e.wait_persisted()
    e.save(_commit_state(7), "B", version=7)
    if commit == "commit":
        e.commit("B")
    # exit now: no wait_snapshot, no wait_persisted, no shutdown


def _killed_mid_flush(root: str) -> None:
    e = CheckpointEngine({"save_dir": root, **TINY})
    e.save(seeded_state(1, 20_000, (30, 40)), "A", version=1); e.commit("A"); e.wait_persisted()

    def die(level, path, offset, nbytes):
        if "/B/" in path and path.endswith(".safetensors") and offset > 0:  # B's second run of chunks
            os.kill(os.getpid(), signal.SIGKILL)

    faults.arm(die)
    e.save(seeded_state(2, 200_000, (30, 40)), "B", version=2); e.commit("B")
    e.wait_persisted()
    raise SystemExit("not killed")


PROGRAMS = {"killed-before-commit": _killed_before_commit, "killed-after-rank-report": _killed_after_rank_report,
            "exit-without-shutdown": _exit_without_shutdown, "killed-mid-flush": _killed_mid_flush}

if __name__ == "__main__":
    PROGRAMS[sys.argv[1]](*sys.argv[2:])
