"""torchrun worker for test_distributed.py: 4 gloo ranks save, commit and load one checkpoint.

Usage: torchrun --nproc-per-node 4 _dist_worker.py ROOT OUT
Each rank saves two files of its own (distinct names), commits, waits; then loads its own files
and one file of the next rank and checks them bit for bit. Writes OUT/rank-R.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, read_manifest

from helpers.states import rank_state


def same(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for k in b:
        if isinstance(b[k], torch.Tensor):
            if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])):
                return False
        elif a[k] != b[k]:
            return False
    return True


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root, out = sys.argv[1], sys.argv[2]
    engine = CheckpointEngine({"save_dir": root, "host_cache_size": 0.0001, "chunk_size_mb": 0.004,
                               "persist_timeout_s": 60, "snapshot_timeout_s": 60})
    outcome = {"rank": rank, "world": world, "run_id": engine.run_id}
    callbacks = []
    for part in ("model", "optim"):
        engine.save(rank_state(rank, part), "iter_0000010", f"{part}_r{rank}", version=10)
    engine.commit("iter_0000010", on_committed=lambda m: callbacks.append(sorted(m["files"])))
    engine.wait_persisted()
    outcome["callback_files"] = callbacks[0] if callbacks else None
    dist.barrier()
    outcome["latest"] = engine.latest()
    outcome["manifest_run_id"] = read_manifest(os.path.join(root, "iter_0000010"))["run_id"]
    checks = {}
    for r in (rank, (rank + 1) % world):
        for part in ("model", "optim"):
            loaded = engine.load("iter_0000010", f"{part}_r{r}")
            checks[f"{part}_r{r}"] = same(loaded, rank_state(r, part))
    outcome["checks"] = checks
    engine.shutdown()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(outcome, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
