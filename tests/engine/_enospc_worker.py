"""A job that fills its file system, for test_enospc.py: run inside a private mount namespace
whose ``ROOT`` is a small tmpfs (``unshare -rm``), so ENOSPC comes from the kernel, not a hook.

Usage: python _enospc_worker.py PROGRAM ROOT

* ``fill``: A committed (~0.4 MB); B (~4 MB, more than the file system holds) saved and
  committed; the ENOSPC must reach the training thread; the process then exits with code 3
  (its engine shut down by the exception, as a trainer's would).
* ``restart``: a new engine on ROOT (a restarted job): it must come up, free B's partial files,
  and load A bit-exact; prints one JSON line of figures.
* ``ballast``: another file fills the file system; a new engine must refuse to start, saying
  how much a save needs against what is free; prints the message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from megatron_ext.engine import CheckpointEngine
from megatron_ext.engine.errors import CheckpointError, ConfigError

from helpers.states import FAST, assert_same, seeded_state

CONFIG = {"host_cache_size": 0.002, "chunk_size_mb": 0.25, **FAST}


def _used(root: str) -> int:
    st = os.statvfs(root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _fill(root: str) -> None:
    with CheckpointEngine({"save_dir": os.path.join(root, "ckpt"), **CONFIG}) as engine:
        engine.save(seeded_state(1, 100_000), "A", version=1)
        engine.commit("A")
        engine.wait_persisted()
        engine.save(seeded_state(2, 1_000_000), "B", version=2)
        engine.commit("B")
        try:
            engine.wait_persisted()
        except CheckpointError as exc:
            print(json.dumps({"error": str(exc), "used": _used(root)}), flush=True)
            raise SystemExit(3)
    raise SystemExit("B was committed: the file system did not fill")


def _restart(root: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    before = _used(root)
    started = time.monotonic()
    engine = CheckpointEngine({"save_dir": os.path.join(root, "ckpt"), **CONFIG})
    came_up = time.monotonic() - started
    latest = engine.latest()
    assert latest == "A", latest
    assert_same(engine.load(latest), seeded_state(1, 100_000))
    print(json.dumps({"came_up_s": round(came_up, 3), "freed": before - _used(root), "latest": latest,
                      "left": sorted(os.listdir(os.path.join(root, "ckpt")))}), flush=True)
    engine.shutdown()


def _ballast(root: str) -> None:
    try:
        with open(os.path.join(root, "ballast"), "wb") as f:
            while True:
                f.write(b"\0" * 65536)
    except OSError:
        pass
    try:
        CheckpointEngine({"save_dir": os.path.join(root, "ckpt"), **CONFIG})
    except ConfigError as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return
    raise SystemExit("the engine started on a full file system")


if __name__ == "__main__":
    program, root = sys.argv[1:3]
    {"fill": _fill, "restart": _restart, "ballast": _ballast}[program](root)
