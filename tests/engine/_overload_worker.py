"""torchrun worker for test_overload.py: 2 gloo ranks checkpoint every iteration through a throttled writer.

Usage: torchrun --nproc-per-node 2 _overload_worker.py ROOT OUT POLICY ITERS [MAX_DURABLE_AGE]
Each iteration overwrites the state in place with ``step_state(rank, i)``, saves it as ``it_<i>``
(version i), commits, "computes" briefly and calls ``wait_snapshot``, as a training loop does.
Rank 1's writer is slower than rank 0's, so the ranks skip different checkpoints on their own.
Writes OUT/rank-R.json with the engine's own record of backpressure waits and its skips.
"""

import json
import os
import sys
import time

import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, faults

from helpers.states import step_state


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, out, policy, iters = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = {"save_dir": root, "host_cache_size": 0.0001, "chunk_size_mb": 0.004, "overload_policy": policy,
           "snapshot_timeout_s": 60, "persist_timeout_s": 60}
    if len(sys.argv) > 5:
        cfg["max_durable_age"] = int(sys.argv[5])
    engine = CheckpointEngine(cfg)
    delay = 0.006 * (1 + rank)  # per 4 KiB chunk written (a write may cover a run of chunks)

    def slow_storage(level, path, offset, nbytes):
        if path.endswith(".safetensors"):
            time.sleep(delay * -(-nbytes // 4096))

    faults.arm(slow_storage)
    state = step_state(rank, 0)
    for i in range(1, iters + 1):
        fresh = step_state(rank, i)
        state["w"].copy_(fresh["w"])
        state["t"].copy_(fresh["t"])
        state["step"] = i
        engine.save(state, f"it_{i:04d}", version=i)
        engine.commit(f"it_{i:04d}")
        time.sleep(0.01)  # forward and backward
        if i < iters:  # before the optimizer step mutates the state; the last save has none after it
            engine.wait_snapshot()
    engine.shutdown()
    skipped = [r for r in engine.telemetry.records if r["event"] == "skipped"]
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "run_id": engine.run_id, "backpressure_waits": engine.backpressure_waits,
                   "age_bound_waits": engine.age_bound_waits, "skipped": skipped}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
