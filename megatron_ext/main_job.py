"""The README's main job: train with a checkpoint every iteration, crash, resume, compare.

Three runs of the reference trainer under torchrun on CPU ranks: an uninterrupted run without
checkpoints, a run with ``--use-datastates --save-interval 1`` whose ranks all SIGKILL
themselves at ``--crash-at``, and a resume with ``--load`` to the end. The resumed losses and
learning rates must equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

from megatron_ext.procs import torchrun_command


def _torchrun(nproc: int, args: list[str], log: str) -> int:
    cmd = torchrun_command(nproc, "-m", "megatron_ext.megatron.trainer", *args)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print("[main-job] $ " + " ".join(["torchrun", f"--nproc-per-node {nproc}", "-m megatron_ext.megatron.trainer",
                                       *args]), flush=True)
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1800)
    with open(log) as f:
        for line in f:
            if line.startswith("iteration") or "[datastates] loaded" in line:
                print("    " + line.rstrip(), flush=True)
    return proc.returncode


def _records(path: str) -> dict[int, dict]:
    with open(path) as f:
        return {r["iteration"]: r for r in map(json.loads, f)}


def main(args) -> int:
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ckpt = os.path.join(out, "checkpoints")
    model = ["--bf16", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--train-iters", str(args.iters)]
    datastates = ["--save", ckpt, "--save-interval", "1", "--use-datastates",
                  "--datastates-host-cache-size", str(args.host_cache_size)]

    print(f"[main-job] 1/3 uninterrupted reference run, {args.iters} iterations, no checkpoints", flush=True)
    if _torchrun(8, [*model, "--log-json", f"{out}/reference.jsonl"], f"{out}/reference.log"):
        print(f"[main-job] reference run failed; see {out}/reference.log")
        return 1
    print(f"[main-job] 2/3 --use-datastates --save-interval 1; every rank SIGKILLs itself after iteration "
          f"{args.crash_at}", flush=True)
    start = time.perf_counter()
    code = _torchrun(8, [*model, *datastates, "--crash-at-iteration", str(args.crash_at),
                         "--log-json", f"{out}/resumed.jsonl"], f"{out}/crashed.log")
    print(f"[main-job]     killed as planned (exit code {code}) after {time.perf_counter() - start:.1f}s", flush=True)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        committed = int(f.read())
    print(f"[main-job]     newest committed checkpoint: iteration {committed}", flush=True)
    with open(f"{out}/resumed.jsonl") as f:
        kept = [line for line in f if json.loads(line)["iteration"] <= committed]
    with open(f"{out}/resumed.jsonl", "w") as f:
        f.writelines(kept)
    print("[main-job] 3/3 resume with --load from the newest committed checkpoint", flush=True)
    if _torchrun(8, [*model, *datastates, "--load", ckpt, "--log-json", f"{out}/resumed.jsonl"], f"{out}/resumed.log"):
        print(f"[main-job] resumed run failed; see {out}/resumed.log")
        return 1

    reference, resumed = _records(f"{out}/reference.jsonl"), _records(f"{out}/resumed.jsonl")
    same = all(resumed.get(i, {}).get("loss") == r["loss"] and resumed[i]["lr"] == r["lr"]
               for i, r in reference.items())
    blocked = []
    tele = os.path.join(ckpt, "datastates_telemetry")
    for name in sorted(os.listdir(tele)):
        with open(os.path.join(tele, name)) as f:
            blocked += [json.loads(l)["blocked_s"] for l in f if '"snapshot"' in l]
    print(f"[main-job] checkpoints taken: {len(blocked) // 8 if blocked else 0} per rank; training blocked "
          f"{sum(blocked) / max(len(blocked), 1) * 1000:.2f} ms per checkpoint and rank on average "
          f"(telemetry in {tele})")
    print(f"[main-job] resumed losses and learning rates equal the uninterrupted run's bit for bit: {same}")
    return 0 if same else 1
