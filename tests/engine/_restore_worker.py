"""torchrun worker for test_restore.py: 2 gloo ranks, each with its own node-local directory.

Usage: torchrun --nproc-per-node 2 _restore_worker.py ROOT OUT DROP_RANK [BACKEND]
Every rank saves and commits one file; rank DROP_RANK (-1: none) then deletes its node-local
copy; all ranks agree on one level and load their file. Writes OUT/rank-R.json. BACKEND is
gloo (default) or nccl (tests/gpu: one GPU per rank, the agreement's all_reduce on the GPU; one
rank on a one-GPU node). It also records ``all_reduce_int`` over the default group, the device
``collective_device`` picks, and (NCCL) whether a host tensor is refused.
"""

import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine
from megatron_ext.engine.collectives import all_reduce_int, collective_device


def rank_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(5000 + rank, generator=g), "ids": torch.arange(rank, rank + 9), "rank": rank}


def main() -> None:
    root, out, drop_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    backend = sys.argv[4] if len(sys.argv) > 4 else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    local = os.path.join(root, f"local-node{rank}")  # one "node" per rank
    config = {"save_dir": os.path.join(root, "shared"), "local_dir": local, "host_cache_size": 0.001,
              "persist_timeout_s": 60, "snapshot_timeout_s": 60}
    with CheckpointEngine(config) as engine:
        engine.save_and_commit(rank_state(rank), "iter_0000001", f"rank{rank}", version=1)
        engine.wait_persisted()
        dist.barrier()
        if rank == drop_rank:
            shutil.rmtree(os.path.join(local, "iter_0000001"))
        ckpt = engine.open_checkpoint("iter_0000001")
        own_complete = ckpt.local_copy_complete(rank)
        level = ckpt.agree_level(rank, dist.get_world_size())
        loaded = ckpt.reader(f"rank{rank}").state()
        want = rank_state(rank)
        exact = all(torch.equal(loaded[k], want[k]) for k in ("w", "ids")) and loaded["rank"] == rank
        # The engine's collectives on the default group: the device rule NCCL enforces, at any world size.
        total = all_reduce_int(rank + 1, dist.ReduceOp.SUM)
        refuses_host = None
        if backend == "nccl":
            try:
                dist.all_reduce(torch.ones(1))
                refuses_host = False
            except Exception:  # NCCL has no CPU path
                refuses_host = True
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
            json.dump({"own_complete": own_complete, "level": level, "levels_used": sorted(ckpt.levels_used),
                       "exact": exact, "backend": dist.get_backend(), "all_reduce_int": total,
                       "collective_device": str(collective_device()), "refuses_host": refuses_host}, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
