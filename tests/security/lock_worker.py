"""A writing job for the locking tests, as a real process: ``python lock_worker.py MODE SAVE_DIR LOCAL_DIR STATUS``.

* ``hold``: commit iter 1, report ``{"pid", "run_id"}`` in STATUS, wait for ``STATUS.go``, commit
  iter 2, shut down cleanly.
* ``crash``: commit iter 1 (as two ranks of one run, in one process), then rank 0 alone commits
  iter 2 (its report is written, the manifest waits for rank 1), report in STATUS and wait to be
  SIGKILLed: a partial checkpoint and a lock whose holder is dead are left behind.
* ``try``: start an engine (under torchrun: every rank of a job) and report in STATUS(.rank)
  whether it started, or the error it raised; a started engine commits iter 3 and shuts down.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from megatron_ext.engine import CheckpointEngine

SMALL = {"host_cache_size": 0.001, "snapshot_timeout_s": 30.0, "persist_timeout_s": 60.0}


def _state(i: int) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) * i, "step": i}


def _write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    mode, save_dir, local_dir, status = sys.argv[1:5]
    config = {"save_dir": save_dir, **SMALL}
    if local_dir != "-":
        config["local_dir"] = local_dir
    if mode == "hold":
        with CheckpointEngine(config, rank=0, world_size=1) as engine:
            engine.save(_state(1), "iter_0000001", version=1)
            engine.commit("iter_0000001")
            engine.wait_persisted()
            _write(status, {"pid": os.getpid(), "run_id": engine.run_id})
            deadline = time.monotonic() + 120
            while not os.path.exists(status + ".go"):
                if time.monotonic() > deadline:
                    raise SystemExit("never told to go on")
                time.sleep(0.05)
            engine.save(_state(2), "iter_0000002", version=2)
            engine.commit("iter_0000002")
    elif mode == "crash":
        run_id = "c0ffee000001"
        store = torch.distributed.HashStore()
        ranks = [CheckpointEngine(config, rank=r, world_size=2, run_id=run_id, commit_store=store) for r in (0, 1)]
        for r, engine in enumerate(ranks):
            engine.save(_state(1), "iter_0000001", f"rank{r}", version=1)
            engine.commit("iter_0000001")
        for engine in ranks:
            engine.wait_persisted()
        ranks[0].save(_state(2), "iter_0000002", "rank0", version=2)
        ranks[0].commit("iter_0000002")
        report = os.path.join(save_dir, "iter_0000002", ".reports", f"rank-00000.{run_id}.json")
        deadline = time.monotonic() + 120
        while not os.path.exists(report):
            if time.monotonic() > deadline:
                raise SystemExit(f"{report} never appeared")
            time.sleep(0.02)
        _write(status, {"pid": os.getpid(), "run_id": run_id})
        time.sleep(300)  # the test kills this process
    elif mode == "try":
        import torch.distributed as dist

        if "RANK" in os.environ:
            dist.init_process_group("gloo")
            status = f"{status}.{dist.get_rank()}"
        try:
            engine = CheckpointEngine(config)
        except Exception as exc:  # reported, not raised: the test reads it
            _write(status, {"ok": False, "type": type(exc).__name__, "error": str(exc)})
        else:
            engine.save(_state(3), "iter_0000003", version=3)
            engine.commit("iter_0000003")
            engine.shutdown()
            _write(status, {"ok": True, "run_id": engine.run_id})
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
