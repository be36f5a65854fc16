"""torchrun worker for the fault-injection tests: the real engine on gloo ranks, faults armed by env.

Steps: checkpoint c001 cleanly; arm the fault (FAULT on rank FAULT_RANK); checkpoint c002 and
wait for it; disarm; checkpoint c003 (not after never_report under on_failure=stop). Each rank writes what happened to OUT/rank-R.json.
FAULT: enospc | eio | slow | never_report | writer_dies.
"""

import errno
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, CheckpointError, faults


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, out = sys.argv[1], sys.argv[2]
    fault, fault_rank = os.environ["FAULT"], int(os.environ.get("FAULT_RANK", "1"))
    config = {"host_cache_size": 0.01, "chunk_size_mb": 0.25, "save_dir": root,
              "on_failure": os.environ.get("ON_FAILURE", "stop"), "persist_timeout_s": float(os.environ.get("TIMEOUT", "8"))}
    engine = CheckpointEngine(config)
    state = lambda i: {"w": torch.full((200_000,), float(i + rank)), "step": i}  # noqa: E731
    outcome: dict = {"rank": rank}

    def attempt(name: str, i: int) -> None:
        start = time.monotonic()
        try:
            if not (fault == "never_report" and rank == fault_rank and name == "c002"):
                engine.save(state(i), name, f"r{rank}", version=i)
                engine.commit(name)
            engine.wait_persisted(name)
            outcome[name] = {"ok": True}
        except CheckpointError as exc:
            outcome[name] = {"ok": False, "error": str(exc)}
        outcome[name]["seconds"] = time.monotonic() - start

    attempt("c001", 1)
    if rank == fault_rank:
        def hook(level, path, offset, nbytes):
            if "c002" not in path:
                return
            if fault == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if fault == "eio":
                raise OSError(errno.EIO, "Input/output error (injected)")
            if fault == "slow":
                time.sleep(0.05)
            if fault == "writer_dies":
                raise SystemExit("writer thread killed (injected)")
        faults.arm(hook)
    attempt("c002", 2)
    faults.disarm_all()
    dist.barrier()
    # After a rank that never reported, rank 0 is stopped and decides nothing more: a rank whose own
    # engine did not fail would wait out its decision on c003 (that timeout is tests/engine/test_deadlines.py's).
    if not (fault == "never_report" and os.environ.get("ON_FAILURE", "stop") == "stop"):
        attempt("c003", 3)
    outcome["latest"] = engine.latest()
    try:
        engine.shutdown()
    except CheckpointError as exc:
        outcome["shutdown_error"] = str(exc)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(outcome, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
