"""torchrun worker for test_peer_replica.py: a toy data-parallel run on 2 simulated nodes x 2 ranks.

Usage: torchrun --nproc-per-node 4 _replica_worker.py PHASE WORK REPLICA_DIR
* ``train``: steps 1..STEPS, a checkpoint after each of steps 1..SAVE_UNTIL (engine with peer
  replicas, node-local level ``WORK/local/node-N``), waits until the last one is committed and
  replicated, trains on without checkpoints (the uninterrupted losses), then every rank SIGKILLs
  itself.
* ``resume``: loads the newest committed checkpoint, trains to STEPS, ends normally.
* ``misordered``: node 1 commits two checkpoints in the other order; records the error.
Each rank writes ``WORK/out/PHASE-rank-R.json`` (losses as float.hex, the level it loaded from).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError

STEPS, SAVE_UNTIL, RANKS_PER_NODE = 6, 4, 2


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 128, generator=g), torch.randn(16, 8, generator=g)


def train_step(model, optimizer, engine, step: int, rank: int, world: int) -> str:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    engine.wait_snapshot()  # the saved tensors change from here on
    optimizer.step()
    return loss.item().hex()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    phase, work, replica_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    node = rank // RANKS_PER_NODE
    engine = CheckpointEngine({"save_dir": os.path.join(work, "ckpt"),
                               "local_dir": os.path.join(work, "local", f"node-{node}"),
                               "peer_replica": True, "ranks_per_node": RANKS_PER_NODE, "replica_dir": replica_dir,
                               "host_cache_size": 0.002, "chunk_size_mb": 0.0625,
                               "persist_timeout_s": 120, "snapshot_timeout_s": 120})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    outcome = {"rank": rank, "losses": {}}
    if phase == "misordered":  # node 1 commits b before a: the replication must stop with a clear error
        for name in ("a", "b") if node == 0 else ("b", "a"):
            engine.save({"w": torch.full((1000,), float(rank))}, name, version=0)
            engine.commit(name)
        try:
            engine.wait_persisted()
            outcome["error"] = None
        except CheckpointError as exc:
            outcome["error"] = str(exc)
        with open(os.path.join(work, "out", f"{phase}-rank-{rank}.json"), "w") as f:
            json.dump(outcome, f)
        dist.barrier()
        return  # the interpreter-exit hook shuts the failed engine down, keeping the replicas
    first = 1
    if phase == "resume":
        latest = engine.latest()
        state = engine.load(latest)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        first = state["step"] + 1
        outcome.update(loaded=latest, level=engine.last_load_level)
        again = engine.load(latest)  # collective again: the copy fetched from the peer is reused
        outcome["reloaded_same"] = (engine.last_load_level == outcome["level"] and
                                    all(torch.equal(again["model"][k], v) for k, v in state["model"].items()))
    for step in range(first, STEPS + 1):
        outcome["losses"][step] = train_step(model, optimizer, engine, step, rank, world)
        if phase == "train" and step <= SAVE_UNTIL:
            engine.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step},
                        f"step{step:03d}", version=step)
            engine.commit(f"step{step:03d}")
        if phase == "train" and step == SAVE_UNTIL:
            engine.wait_persisted()  # committed, and the replicas are with the peers
            outcome["replica_events"] = [r["checkpoint"] for r in engine.telemetry.records if r["event"] == "replica"]
    with open(os.path.join(work, "out", f"{phase}-rank-{rank}.json"), "w") as f:
        json.dump(outcome, f)
    if phase == "train":
        dist.barrier()  # every rank's replicas are complete; now the whole job dies at once
        os.kill(os.getpid(), signal.SIGKILL)
    engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
