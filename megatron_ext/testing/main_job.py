"""The README's main job: train, SIGKILL every rank mid-run, resume, compare bit for bit.

The trainer is Megatron-LM's own ``pretrain_gpt.py`` (the patched checkout of the pin that
``megatron_lm.find_checkout()`` provides) on 8 CPU ranks through the test harness
``megatron_ext.testing.megatron_lm``. Without that checkout the job falls back to the reference
trainer ``megatron_ext.testing.reference_trainer`` (a megatron-core GPT, same layout) and says so in its
first line and in its summary. Either way: TP=2 x PP=2 x DP=2, bf16, distributed optimizer, and
three runs of the same job:

1. uninterrupted, without checkpoints: the oracle;
2. ``--use-datastates --save-interval 1``; every rank SIGKILLs itself right after iteration K's
   save call (the newest checkpoints are still in flight);
3. resumed with ``--load`` from the newest committed checkpoint, to the end.

Every iteration's loss (and, with Megatron-LM, grad norm) must equal the oracle's bit for bit,
in the killed run up to the kill and in the resumed run after its checkpoint.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

from megatron_ext import procs
from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE
from megatron_ext.testing import megatron_lm

RANKS = 8
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--bf16",
          "--use-distributed-optimizer"]
RUN_TIMEOUT_S = 900
PROGRESS_POLL_S = 0.5


def say(message: str) -> None:
    print(f"[main-job] {message}", flush=True)


@dataclasses.dataclass(frozen=True)
class Step:
    iteration: int
    loss: float
    grad_norm: float | None  # the reference trainer does not record it
    lr: float


@dataclasses.dataclass
class Trainer:
    """How to run one of the two trainers and read what it recorded."""

    title: str
    command: Callable[[list[str], Path, int | None], list[str]]  # (args, record file, kill at) -> argv
    env: dict
    read: Callable[[Path], list[Step]]
    compared: str  # what is compared bit for bit, for the verdict


# ---------------------------------------------------------------------------- the two trainers
def megatron_trainer(checkout: Path, iters: int) -> Trainer:
    model = [*megatron_lm.TINY_GPT, *LAYOUT, "--train-iters", str(iters)]

    def command(args: list[str], record: Path, kill_at: int | None) -> list[str]:
        return megatron_lm.torchrun_command(RANKS, [*model, *args], checkout, record=str(record), kill_at=kill_at)

    def read(record: Path) -> list[Step]:
        return [Step(r["iteration"], r["loss"], r["grad_norm"], r["lr"]) for r in megatron_lm.read_records(record)]

    return Trainer(f"Megatron-LM's own pretrain_gpt.py from {checkout} (the pinned core_v0.16.1 with the "
                   f"megatron_ext patches), on CPU ranks through megatron_ext.testing.megatron_lm",
                   command, megatron_lm.environment(), read, "loss and grad norm")


def reference_trainer_run(iters: int) -> Trainer:
    model = [*LAYOUT, "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", str(iters)]

    def command(args: list[str], record: Path, kill_at: int | None) -> list[str]:
        crash = [] if kill_at is None else ["--crash-at-iteration", str(kill_at)]
        return procs.torchrun_command(RANKS, "-m", "megatron_ext.testing.reference_trainer", *model, *args, *crash,
                                      "--log-json", str(record))

    def read(record: Path) -> list[Step]:
        if not record.exists():
            return []
        rows = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
        return [Step(r["iteration"], float.fromhex(r["loss"]), None, float.fromhex(r["lr"])) for r in rows]

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return Trainer("the reference trainer megatron_ext.testing.reference_trainer (a megatron-core GPT), on CPU ranks",
                   command, env, read, "loss and learning rate")


# ---------------------------------------------------------------------------- one run
@dataclasses.dataclass
class Run:
    name: str
    steps: list[Step]
    log: str
    returncode: int
    seconds: float


def run(trainer: Trainer, name: str, args: list[str], out: Path, kill_at: int | None = None) -> Run:
    """One torchrun of the trainer; prints every recorded iteration as it comes."""
    record, log_path = out / f"{name}.jsonl", out / f"{name}.log"
    record.unlink(missing_ok=True)
    cmd = trainer.command(args, record, kill_at)
    (out / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
    start = time.monotonic()
    shown = 0
    with open(log_path, "w") as log:
        # A session of its own: whatever the job leaves behind (data loader workers of a killed
        # rank) is ended with it below.
        proc = subprocess.Popen(cmd, env=trainer.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=PROGRESS_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                shown = _show_progress(trainer, record, shown)
                if time.monotonic() - start > RUN_TIMEOUT_S:
                    log.write(f"\n[main-job] timed out after {RUN_TIMEOUT_S}s: killing the job\n")
                    returncode = -signal.SIGKILL
                    break
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    _show_progress(trainer, record, shown)
    text = log_path.read_text(errors="replace")
    return Run(name, trainer.read(record), text, returncode, time.monotonic() - start)


def _show_progress(trainer: Trainer, record: Path, shown: int) -> int:
    try:
        steps = trainer.read(record)
    except ValueError:  # a line being written right now: show it next time
        return shown
    for step in steps[shown:]:
        norm = f"  grad norm {step.grad_norm:.8f}" if step.grad_norm is not None else ""
        print(f"    iteration {step.iteration:3d}  loss {step.loss:.8f}{norm}  lr {step.lr:.3e}", flush=True)
    return len(steps)


def _failed(run_: Run, out: Path) -> str:
    tail = "\n".join("    " + line for line in run_.log.splitlines()[-25:])
    log = out / f"{run_.name}.log"
    return f"{run_.name} run ended with exit code {run_.returncode}; last lines of {log}:\n{tail}"


# ---------------------------------------------------------------------------- the job
def main(args) -> int:
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpt = out / "checkpoints"
    started = time.monotonic()

    if args.trainer == "reference":
        checkout, reason = None, "--trainer reference was given"
    else:
        checkout, reason = megatron_lm.find_checkout()
        if checkout is None and args.trainer == "megatron":
            say(f"error: --trainer megatron, but {reason}")
            return 2
    iters = args.iters or (10 if checkout else 12)
    crash_at = args.crash_at or (6 if checkout else 7)
    if not 1 <= crash_at < iters:
        say(f"error: --crash-at must be between 1 and --iters - 1 ({iters - 1}), not {crash_at}")
        return 2
    if checkout is not None:
        trainer = megatron_trainer(checkout, iters)
        fallback = ""
        say(f"trainer: {trainer.title}")
    else:
        trainer = reference_trainer_run(iters)
        fallback = (f"FALLBACK to the reference trainer, not Megatron-LM's pretrain_gpt.py: {reason}")
        say(fallback)
    say(f"{RANKS} ranks: TP=2 x PP=2 x DP=2, bf16, distributed optimizer; {iters} iterations; work directory {out}")

    datastates = ["--use-datastates", "--save", str(ckpt), "--save-interval", "1",
                  "--datastates-host-cache-size", str(args.host_cache_size)]

    say(f"1/3 uninterrupted run, {iters} iterations, no checkpoints (the oracle)")
    oracle = run(trainer, "uninterrupted", [], out)
    if oracle.returncode != 0 or len(oracle.steps) != iters:
        say(_failed(oracle, out))
        return 1
    say(f"    done in {oracle.seconds:.0f}s")

    say(f"2/3 --use-datastates --save-interval 1; every rank SIGKILLs itself after iteration {crash_at}'s save call")
    killed = run(trainer, "killed", datastates, out, kill_at=crash_at)
    if killed.returncode == 0 or not killed.steps or killed.steps[-1].iteration != crash_at:
        say(_failed(killed, out) + f"\n    (expected a SIGKILL after iteration {crash_at})")
        return 1
    tracker = ckpt / TRACKER_FILE
    committed = int(tracker.read_text()) if tracker.exists() else None
    if committed is None:
        say(f"no checkpoint was committed before the kill (no {tracker})")
        return 1
    lost = list(range(committed + 1, crash_at + 1))
    in_flight = ("" if not lost else f"; the checkpoint of iteration {lost[0]} was still in flight and is discarded"
                 if len(lost) == 1 else f"; the checkpoints of iterations {lost[0]}..{lost[-1]} were still in "
                 f"flight and are discarded")
    say(f"    killed (exit code {killed.returncode}) after {killed.seconds:.0f}s; newest committed checkpoint: "
        f"iteration {committed}{in_flight}")

    say(f"3/3 resume with --load {ckpt} (newest committed checkpoint) to iteration {iters}")
    resumed = run(trainer, "resumed", [*datastates, "--load", str(ckpt)], out)
    if resumed.returncode != 0:
        say(_failed(resumed, out))
        return 1
    loaded = re.search(r"\[datastates\] loaded (\S+) from \S+ \((\w+) level\) in ([0-9.]+)s", resumed.log)
    if loaded:
        say(f"    loaded {loaded.group(1)} from the {loaded.group(2)} level in {loaded.group(3)}s")
    say(f"    done in {resumed.seconds:.0f}s")

    # ------------------------------------------------------------------ verdict
    expected = {s.iteration: s for s in oracle.steps}
    problems = []
    first_resumed = resumed.steps[0].iteration if resumed.steps else None
    if first_resumed != committed + 1:
        problems.append(f"the resumed run started at iteration {first_resumed}, not {committed + 1}")
    if [s.iteration for s in resumed.steps] != list(range(committed + 1, iters + 1)):
        problems.append(f"the resumed run recorded iterations {[s.iteration for s in resumed.steps]}")
    for which, steps in (("killed", killed.steps), ("resumed", resumed.steps)):
        for step in steps:
            if step != expected.get(step.iteration):
                problems.append(f"{which} run, iteration {step.iteration}: {step} != uninterrupted "
                                f"{expected.get(step.iteration)}")
    compared = len(killed.steps) + len(resumed.steps)

    blocked = []
    for path in sorted(glob.glob(str(ckpt / "datastates_telemetry" / "rank-*.jsonl"))):
        with open(path) as f:
            blocked += [r["blocked_s"] * 1000 for r in map(json.loads, f) if r.get("event") == "snapshot"]

    say("summary")
    print(f"    trainer:         {fallback or trainer.title}", flush=True)
    print(f"    run:             {RANKS} CPU ranks, TP=2 x PP=2 x DP=2, bf16, distributed optimizer, "
          f"{iters} iterations", flush=True)
    print(f"    kill:            SIGKILL on every rank after iteration {crash_at}; newest committed checkpoint "
          f"then: iteration {committed}", flush=True)
    print(f"    resume:          from iteration {committed}, trained {committed + 1}..{iters}", flush=True)
    if blocked:
        print(f"    checkpoints:     one every iteration; training blocked {statistics.mean(blocked):.1f} ms per "
              f"checkpoint and rank on average, {max(blocked):.1f} ms at most ({len(blocked)} checkpoint x rank "
              f"records in {ckpt / 'datastates_telemetry'})", flush=True)
    print(f"    wall time:       {time.monotonic() - started:.0f}s; logs in {out}", flush=True)
    for problem in problems[:10]:
        print(f"    MISMATCH: {problem}", flush=True)
    if problems:
        say(f"FAIL: {len(problems)} differences from the uninterrupted run")
    else:
        say(f"PASS: {trainer.compared} of all {iters} iterations ({compared} recorded steps in the killed and "
            f"resumed runs) equal the uninterrupted run's bit for bit")
    if fallback:
        say("note: this was the reference trainer (fallback), not Megatron-LM's pretrain_gpt.py")
    return 1 if problems else 0
