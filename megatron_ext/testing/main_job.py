"""The README's main job: train, SIGKILL every rank mid-run, resume, compare bit for bit.

The trainer is Megatron-LM's own ``pretrain_gpt.py`` (the patched checkout of the pin that
``megatron_lm.find_checkout()`` provides, or ``--checkout``) training a Llama-style GPT (SwiGLU,
RMSNorm, rotary, grouped-query attention, untied embeddings) on 8 CPU ranks through the test
harness ``megatron_ext.testing.megatron_lm``, whose default group refuses host tensors as NCCL
does; or, with ``--device cuda`` (``scripts/gpu_check.sh``), on the node's GPUs over real NCCL,
deterministic, with Transformer Engine when it imports. Without a checkout the CPU job falls back
to the reference trainer ``megatron_ext.testing.reference_trainer`` (a megatron-core GPT, same
layout) and says so in its first line and in its summary. Either way: TP=2 x PP=2 x DP=2 on 8
ranks (``Layout.for_ranks`` for other counts), bf16, distributed optimizer, and three runs of the
same job:

1. uninterrupted, without checkpoints: the oracle;
2. ``--use-datastates --save-interval 1``; every rank SIGKILLs itself right after iteration K's
   save call (the newest checkpoints are still in flight), which it makes only once iteration
   K - 2 is committed (``commit_wait``, bounded): fast GPU iterations outrun the flush, and a
   kill with nothing committed would test nothing;
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
import sys
import time
from pathlib import Path
from typing import Callable

from megatron_ext import procs
from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE
from megatron_ext.testing import megatron_lm

RANKS = 8
RUN_TIMEOUT_S = 900
PROGRESS_POLL_S = 0.5


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


#: Where the progress lines go: stdout, or stderr with ``--json`` (then stdout holds one JSON object).
_progress = sys.stdout


def say(message: str) -> None:
    print(f"[main-job] {message}", file=_progress, flush=True)


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
    command: Callable[[list[str], Path, int | None, int | None], list[str]]  # (args, record, kill at, committed before)
    env: dict
    read: Callable[[Path], list[Step]]
    compared: str  # what is compared bit for bit, for the verdict


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job's ranks and how they split into tensor, pipeline and data parallelism."""

    ranks: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @classmethod
    def for_ranks(cls, ranks: int) -> "Layout":
        """TP 2 when the ranks split in two, then PP 2 when they split in four, the rest data parallel."""
        tp = 2 if ranks % 2 == 0 else 1
        pp = 2 if ranks % (2 * tp) == 0 and ranks >= 4 else 1
        return cls(ranks, tp, pp)

    def flags(self) -> list[str]:
        return ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
                "--bf16", "--use-distributed-optimizer"]

    def __str__(self) -> str:
        return f"TP={self.tp} x PP={self.pp} x DP={self.dp}"


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # absent, or present without its CUDA libraries
        return False
    return True


# ---------------------------------------------------------------------------- the two trainers
def megatron_trainer(checkout: Path, iters: int, layout: Layout, device: str = "cpu") -> Trainer:
    """Megatron-LM's pretrain_gpt.py on a Llama-style model: CPU ranks (emulated NCCL) or the node's GPUs (NCCL).

    On GPUs the run is deterministic (``--deterministic-mode`` and the environment it asks for) so
    that a resumed run can equal the uninterrupted one bit for bit, and uses Transformer Engine
    when it imports.
    """
    model = [*megatron_lm.TINY_GPT, *megatron_lm.LLAMA_STYLE, *layout.flags(), "--train-iters", str(iters)]
    env = megatron_lm.environment(gpu=device == "cuda")
    if device == "cuda":
        impl = "transformer_engine" if transformer_engine_available() else "local"
        model += ["--deterministic-mode", "--transformer-impl", impl]
        env.update(NCCL_ALGO="Ring", CUBLAS_WORKSPACE_CONFIG=":4096:8", NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")
        where = f"on {layout.ranks} GPU(s) over NCCL, --transformer-impl {impl}"
    else:
        where = "on CPU ranks (NCCL emulated over gloo) through megatron_ext.testing.megatron_lm"

    def command(args: list[str], record: Path, kill_at: int | None, committed_before: int | None) -> list[str]:
        return megatron_lm.torchrun_command(layout.ranks, [*model, *args], checkout, record=str(record),
                                            kill_at=kill_at, committed_before_kill=committed_before)

    def read(record: Path) -> list[Step]:
        return [Step(r["iteration"], r["loss"], r["grad_norm"], r["lr"]) for r in megatron_lm.read_records(record)]

    return Trainer(f"Megatron-LM's own pretrain_gpt.py from {checkout} (the pinned core_v0.19.0 with the "
                   f"megatron_ext patches), a Llama-style GPT (SwiGLU, RMSNorm, rotary, GQA, untied), {where}",
                   command, env, read, "loss and grad norm")


def reference_trainer_run(iters: int, layout: Layout) -> Trainer:
    model = [*layout.flags(), "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", str(iters)]

    def command(args: list[str], record: Path, kill_at: int | None, committed_before: int | None) -> list[str]:
        crash = [] if kill_at is None else ["--crash-at-iteration", str(kill_at)]
        if committed_before is not None:
            crash += ["--committed-before-crash", str(committed_before)]
        return procs.torchrun_command(layout.ranks, "-m", "megatron_ext.testing.reference_trainer", *model, *args,
                                      *crash, "--log-json", str(record))

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


def committed_before(crash_at: int) -> int:
    """The iteration that must be committed before the kill's save call: two behind, at least the first."""
    return max(1, crash_at - 2)


def run(trainer: Trainer, name: str, args: list[str], out: Path, kill_at: int | None = None) -> Run:
    """One torchrun of the trainer; prints every recorded iteration as it comes."""
    record, log_path = out / f"{name}.jsonl", out / f"{name}.log"
    record.unlink(missing_ok=True)
    cmd = trainer.command(args, record, kill_at, committed_before(kill_at) if kill_at is not None else None)
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
        finally:  # also on SIGTERM (an outer timeout): the tree (ranks have sessions of their own), then the group
            procs.kill_tree(proc)
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
        print(f"    iteration {step.iteration:3d}  loss {step.loss:.8f}{norm}  lr {step.lr:.3e}", file=_progress,
              flush=True)
    return len(steps)


def _failed(run_: Run, out: Path) -> str:
    tail = "\n".join("    " + line for line in run_.log.splitlines()[-25:])
    log = out / f"{run_.name}.log"
    return f"{run_.name} run ended with exit code {run_.returncode}; last lines of {log}:\n{tail}"


# ---------------------------------------------------------------------------- the job
def _terminated(signum, frame) -> None:
    """SIGTERM (``timeout``, a scheduler): unwind, so the running job's processes are killed on the way."""
    raise SystemExit(128 + signum)


def main(args) -> int:
    global _progress
    _progress = sys.stderr if getattr(args, "json", False) else sys.stdout
    signal.signal(signal.SIGTERM, _terminated)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpt = out / "checkpoints"
    started = time.monotonic()

    device = getattr(args, "device", "cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            say("error: --device cuda, but torch sees no CUDA device")
            return 2
    ranks = getattr(args, "ranks", None) or (_gpu_count() if device == "cuda" else RANKS)
    layout = Layout.for_ranks(ranks)
    if args.trainer == "reference":
        checkout, reason = None, "--trainer reference was given"
    elif getattr(args, "checkout", None):
        checkout, reason = Path(args.checkout).resolve(), ""
        if not (checkout / "pretrain_gpt.py").is_file():
            say(f"error: --checkout {checkout} has no pretrain_gpt.py")
            return 2
    else:
        checkout, reason = megatron_lm.find_checkout()
    if checkout is None and (args.trainer == "megatron" or device == "cuda"):
        say(f"error: {'--device cuda' if device == 'cuda' else '--trainer megatron'}, but {reason}")
        return 2
    iters = args.iters or (10 if checkout else 12)
    crash_at = args.crash_at or (6 if checkout else 7)
    if not 1 <= crash_at < iters:
        say(f"error: --crash-at must be between 1 and --iters - 1 ({iters - 1}), not {crash_at}")
        return 2
    if checkout is not None:
        trainer = megatron_trainer(checkout, iters, layout, device)
        fallback = ""
        say(f"trainer: {trainer.title}")
    else:
        trainer = reference_trainer_run(iters, layout)
        fallback = (f"FALLBACK to the reference trainer, not Megatron-LM's pretrain_gpt.py: {reason}")
        say(fallback)
    say(f"{layout.ranks} ranks: {layout}, bf16, distributed optimizer; {iters} iterations; work directory {out}")

    datastates = ["--use-datastates", "--save", str(ckpt), "--save-interval", "1",
                  "--datastates-host-cache-size", str(args.host_cache_size)]

    say(f"1/3 uninterrupted run, {iters} iterations, no checkpoints (the oracle)")
    oracle = run(trainer, "uninterrupted", [], out)
    if oracle.returncode != 0 or len(oracle.steps) != iters:
        say(_failed(oracle, out))
        return 1
    say(f"    done in {oracle.seconds:.0f}s")

    say(f"2/3 --use-datastates --save-interval 1; every rank SIGKILLs itself after iteration {crash_at}'s save call, "
        f"made once iteration {committed_before(crash_at)} is committed")
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

    summary = {
        "trainer": "megatron-lm" if checkout is not None else "reference", "title": fallback or trainer.title,
        "device": device, "ranks": layout.ranks, "layout": str(layout), "iterations": iters, "crash_at": crash_at,
        "committed_at_kill": committed, "resumed_from": committed, "steps_compared": compared,
        "blocked_ms_mean": statistics.mean(blocked) if blocked else None,
        "blocked_ms_max": max(blocked) if blocked else None, "wall_s": time.monotonic() - started,
        "work_dir": str(out), "passed": not problems, "mismatches": problems[:10],
    }
    if getattr(args, "json", False):
        print(json.dumps(summary), flush=True)
        return 1 if problems else 0
    say("summary")
    print(f"    trainer:         {summary['title']}", flush=True)
    print(f"    run:             {layout.ranks} {'GPU' if device == 'cuda' else 'CPU'} ranks, {layout}, bf16, "
          f"distributed optimizer, {iters} iterations", flush=True)
    print(f"    kill:            SIGKILL on every rank after iteration {crash_at}; newest committed checkpoint "
          f"then: iteration {committed}", flush=True)
    print(f"    resume:          from iteration {committed}, trained {committed + 1}..{iters}", flush=True)
    if blocked:
        print(f"    checkpoints:     one every iteration; training blocked {summary['blocked_ms_mean']:.1f} ms per "
              f"checkpoint and rank on average, {summary['blocked_ms_max']:.1f} ms at most ({len(blocked)} "
              f"checkpoint x rank records in {ckpt / 'datastates_telemetry'})", flush=True)
    print(f"    wall time:       {summary['wall_s']:.0f}s; logs in {out}", flush=True)
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
