"""torchrun worker for test_exit_gate.py: 2 gloo ranks save a parameter whose other half an
all-gather fills in (``--overlap-param-gather`` in small), behind a ``CopyGate``, commit, and
end without any wait or shutdown: the interpreter's exit hook is left to commit it.

Usage: torchrun --nproc-per-node 2 _exit_gate_worker.py ROOT HOW

* ``exit``: the script just ends (a normal exit on every rank): the hook runs the all-gather.
* ``raise``: an uncaught exception right after the save, on every rank: no collective at exit,
  the held copy fails, nothing is committed.
* ``raise-gathered``: the same, after the all-gather already ran (the gate's ``ready``): committed.

Iteration 1 is saved and waited for first; iteration 2 is the one left to the exit hook. The
committed iteration is written to ROOT/tracker.txt by rank 0's ``on_committed`` (a tracker).
"""

import logging
import os
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CopyGate

N = 50_000


def shard(rank: int, iteration: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * iteration + rank))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("megatron_ext.engine").setLevel(logging.INFO)  # what the exit hook did, for the test
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, how = sys.argv[1], sys.argv[2]
    engine = CheckpointEngine({"save_dir": root, "host_cache_size": 0.001, "chunk_size_mb": 0.064,
                               "persist_timeout_s": 60, "snapshot_timeout_s": 60})
    param = torch.zeros(2 * N)
    gathered = []

    def all_gather() -> None:
        dist.all_gather_into_tensor(param, param[rank * N:(rank + 1) * N].clone())
        gathered.append(True)

    def tracker(iteration: int):
        def write(manifest: dict) -> None:
            if rank == 0:
                with open(os.path.join(root, "tracker.txt"), "w") as f:
                    f.write(str(iteration))
        return write

    for iteration in (1, 2):
        param.zero_()
        param[rank * N:(rank + 1) * N] = shard(rank, iteration)  # this rank's step updated its shard
        ready = {"ready": lambda: bool(gathered)} if how == "raise-gathered" else {}  # the plain gate elsewhere
        gate = CopyGate(all_gather, "the test's all-gather", **ready)
        gathered.clear()
        name = f"iter_{iteration:07d}"
        engine.save({"param": param}, name, f"rank{rank:05d}", version=iteration, gate=gate)
        engine.commit(name, on_committed=tracker(iteration))
        if iteration == 1:
            engine.wait_persisted()  # settles its gate: the all-gather runs here
    if how == "raise-gathered":
        all_gather()
    if how.startswith("raise"):
        raise RuntimeError("the trainer failed right after the save")


if __name__ == "__main__":
    main()
