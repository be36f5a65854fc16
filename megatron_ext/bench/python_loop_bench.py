"""``megatron-ext bench python-loop``: a Python-bound training loop checkpointing every iteration.

On a GPU node the training loop is Python-bound: one thread launches kernels asynchronously, and
whatever holds the GIL in the background delays every launch. Torch compute releases the GIL, so
the other benchmarks cannot see this. Here the "forward and backward" of each iteration is a fixed
amount of pure-Python work (calibrated once to ``--work-s`` seconds and the same in every mode),
then ``wait_snapshot`` (or its equivalent), a small in-place update of the saved tensors, and one
save of the whole state per iteration:

* ``none``: no checkpoint (the baseline);
* ``datastates``: ``CheckpointEngine.save`` + ``commit`` (``wait_snapshot`` before the update);
* ``dcp_async``: ``torch.distributed.checkpoint.async_save``, thread executor, its default
  (synchronous) staging: the call returns once the state is copied;
* ``dcp_stager``: the same with one ``DefaultStager`` kept for the run, asynchronous staging, and the
  wait on ``staging_completion`` right before the update (DCP's own lazy snapshot);
* ``dcp_process``: ``AsyncCheckpointerType.PROCESS`` (the upload in a helper process) with one
  ``DefaultStager`` of shared-memory buffers, asynchronous staging, ``staging_completion`` waited
  for before the update;
* ``torch_checkpointing``: meta-pytorch's ``CheckpointManager`` at its best documented setting
  (``bench/torch_checkpointing_peer.py``): ``save`` returns at once, staging on its thread into
  shared memory, its subprocess writing; the update under ``manager.lock()``. Where it cannot run
  (not installed), the JSON says why under ``skipped``.

Besides the iteration time, each mode reports the training thread's time *off the CPU* during its
pure-Python work (``offcpu_s_<mode>``: wall time less the thread's own CPU time). The work never
blocks by itself, so that is time spent waiting for the GIL or for a core taken by the saver:
what a checkpoint takes from the training loop, measured inside each process and so not moved by
the drift of the machine's speed between processes, which on a shared virtual machine is larger
than the effect (compare ``iter_s_none`` over rounds). Children run with ``OMP_NUM_THREADS=1``
unless it is set, as torchrun starts every rank: torch's intra-op threads in a CPU copy would
otherwise take the training thread's core, for every mode alike.

For DCP a new save first waits for the previous upload (one checkpoint in flight, as torchtitan and
Megatron-LM do); that wait counts as blocked time. Each mode runs in a fresh process (the GIL is a
per-process affair, and DCP's helper process or threads must not outlive their mode), rounds
alternate the modes' order (reversed every other round, ``--repeats``, default 3), and the figure per
mode is the median iteration over its rounds, each round's under ``iter_s_<mode>_by_round`` and their
spread (max - min) under ``iter_s_<mode>_spread`` (likewise ``blocked_s_``, ``offcpu_s_``);
``ratio_<mode>``: medians' ratio; ``ratio_<mode>_per_round``: the median of each round's ratio to
that round's ``none``, each round's under ``ratio_<mode>_by_round``.

The *GIL account* (``--account``) reruns the engine with one part changed at a time: the copies
off (``copy``), the commit off (``commit``), and the flush's checksums and writes on the engine's
threads in this process instead of the I/O worker process (``worker``: ``flush_process: false``).
It reports the training thread's off-CPU time each accounts for (the full engine's less that
run's; negative for ``worker``: what the worker process saves), plus each engine thread's CPU
seconds per iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

from megatron_ext.arg_types import NONNEG_INT, POSITIVE, POSITIVE_INT, number
from megatron_ext.bench.common import DEFAULT_REPEATS, figure_over_rounds, round_order

NAME = "python-loop"
HELP = ("a Python-bound training loop saving every iteration: this engine vs "
        "DCP async_save (thread, DefaultStager, process) and torch_checkpointing, iteration time vs none")

MODES = ("none", "datastates", "dcp_async", "dcp_stager", "dcp_process", "torch_checkpointing")
#: The modes of other libraries: one that cannot run is reported under ``skipped``, not dropped.
PEERS = ("dcp_async", "dcp_stager", "dcp_process", "torch_checkpointing")
#: What the account changes, one at a time (each mode: the engine less that part).
STAGES = ("copy", "commit", "worker")


def _progress(msg: str) -> None:
    print(f"[bench python-loop] {msg}", file=sys.stderr, flush=True)


def python_work(n: int) -> int:
    """The Python-bound "forward and backward": ``n`` rounds of interpreter work, no C call that drops the GIL."""
    acc = 0
    table: dict[int, int] = {}
    for i in range(n):
        acc = (acc + i * i) % 1000003
        table[i & 1023] = acc
    return acc + len(table)


def calibrate(work_s: float) -> int:
    """Rounds of ``python_work`` that take about ``work_s`` seconds on this machine now."""
    n = 200_000
    while True:
        t0 = time.perf_counter()
        python_work(n)
        elapsed = time.perf_counter() - t0
        if elapsed > 0.2:
            break
        n *= 2
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        python_work(n)
        runs.append(time.perf_counter() - t0)
    return max(1, int(n * work_s / min(runs)))


# ---------------------------------------------------------------------------------------------- child


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every live thread of this process, by thread name, and of its
    child processes together."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    me = psutil.Process()
    for t in me.threads():
        name = names.get(t.id, "other")
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    for child in me.children(recursive=True):  # the engine's I/O worker, DCP's upload process
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        out["child processes"] = out.get("child processes", 0.0) + times.user + times.system
    return out


def _switch_off(stage: str | None) -> None:
    """For the GIL account: run the engine with its copies doing nothing (the checkpoint is then not valid)."""
    if stage == "copy":
        from megatron_ext.engine.save.flow import copier

        copier.CpuCopier.copy_many = lambda self, parts: None
    elif stage not in (None, "commit", "worker"):
        raise ValueError(f"unknown stage {stage!r}")


class _Saver:
    """One way of saving: ``before_update`` (the wait for the snapshot) and ``save`` (after the update)."""

    def before_update(self) -> None:
        return None

    def after_update(self) -> None:
        return None

    def save(self, state: dict, step: int) -> None:
        return None

    def close(self) -> None:
        return None


class _Datastates(_Saver):
    def __init__(self, state: dict, directory: str, stage_off: str | None):
        from megatron_ext.bench.common import state_bytes
        from megatron_ext.engine import CheckpointEngine

        _switch_off(stage_off)
        self.commit = stage_off != "commit"
        cache_gb = max(state_bytes(state) / 2**30 * 1.02, 0.01)
        # No retention: DCP has none either (each child's directory is removed after its run).
        self.engine = CheckpointEngine({"host_cache_size": cache_gb, "save_dir": directory,
                                        "flush_process": stage_off != "worker"}, rank=0, world_size=1)
        self.engine.cache.wait_allocated(600)  # a trainer allocates it once, long before its first save

    def before_update(self) -> None:
        self.engine.wait_snapshot()

    def save(self, state: dict, step: int) -> None:
        name = f"step_{step:05d}"
        self.engine.save(state, name, version=step)
        if self.commit:
            self.engine.commit(name)

    def close(self) -> None:
        self.engine.shutdown()


class _TorchCheckpointing(_Saver):
    """torch_checkpointing's manager at its best documented setting; its lock around the update."""

    def __init__(self, state: dict, directory: str):
        from megatron_ext.bench.torch_checkpointing_peer import Saver

        self.peer = Saver(state, directory)
        self.lock = None

    def before_update(self) -> None:
        self.lock = self.peer.update()
        self.lock.__enter__()  # left by after_update, once the tensors are changed

    def after_update(self) -> None:
        self.lock.__exit__(None, None, None)

    def save(self, state: dict, step: int) -> None:
        self.peer.save(state, f"step_{step:05d}")

    def close(self) -> None:
        self.peer.close()


class _Dcp(_Saver):
    """DCP ``async_save`` at one of its settings; one upload in flight (the next save waits for it)."""

    def __init__(self, mode: str, directory: str):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        from megatron_ext.bench.common import ensure_process_group

        ensure_process_group(directory)
        self.dcp, self.mode, self.directory = dcp, mode, directory
        self.kind = AsyncCheckpointerType.PROCESS if mode == "dcp_process" else AsyncCheckpointerType.THREAD
        self.stager = None
        if mode in ("dcp_stager", "dcp_process"):
            # No pinning or non-blocking copies without CUDA; shared memory for the helper process.
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False,
                                                       use_shared_memory=mode == "dcp_process",
                                                       use_async_staging=True, use_non_blocking_copy=False))
        self.upload = None
        self.staging = None

    def before_update(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def save(self, state: dict, step: int) -> None:
        if self.upload is not None:
            self.upload.result()
        out = self.dcp.async_save(state, checkpoint_id=os.path.join(self.directory, f"step_{step:05d}"),
                                  async_checkpointer_type=self.kind, async_stager=self.stager)
        if self.stager is not None:
            self.staging, self.upload = out.staging_completion, out.upload_completion
        else:
            self.upload = out

    def close(self) -> None:
        if self.upload is not None:
            self.upload.result()
        if self.stager is not None:
            self.stager.close()


def child(mode: str, rounds_n: int, size_gb: float, iters: int, directory: str, stage_off: str | None,
          tensor_mb: float = 64.0) -> dict:
    import torch

    from megatron_ext.bench.common import make_state

    torch.manual_seed(0)
    state = make_state(int(size_gb * 1e9), int(tensor_mb * (1 << 20)))
    os.makedirs(directory, exist_ok=True)
    if mode == "none":
        saver: _Saver = _Saver()
    elif mode == "datastates":
        saver = _Datastates(state, directory, stage_off)
    elif mode == "torch_checkpointing":
        saver = _TorchCheckpointing(state, directory)
    else:
        saver = _Dcp(mode, directory)
    iter_s, blocked_s, offcpu_s = [], [], []
    cpu_before = _thread_cpu()
    started = time.perf_counter()
    for step in range(1, iters + 1):
        t0 = time.perf_counter()
        c0 = time.thread_time()
        python_work(rounds_n)  # forward and backward: Python launching kernels
        b0 = time.perf_counter()
        # Off the CPU during pure-Python work: waiting for the GIL or for a core, never its own doing.
        offcpu_s.append((b0 - t0) - (time.thread_time() - c0))
        saver.before_update()  # the snapshot must be complete before the tensors change
        for t in state.values():  # the optimizer's in-place update (a few elements of each tensor)
            t.view(-1)[:1024].add_(1)
        saver.after_update()
        b1 = time.perf_counter()
        saver.save(state, step)
        b2 = time.perf_counter()
        iter_s.append(b2 - t0)
        blocked_s.append((b1 - b0) + (b2 - b1))
    elapsed = time.perf_counter() - started
    cpu_after = _thread_cpu()
    saver.close()
    cpu = {name: cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0) for name in cpu_after}
    return {"iter_s": iter_s, "blocked_s": blocked_s, "offcpu_s": offcpu_s, "loop_s": elapsed,
            # Threads under 1 ms are noise, except the engine's own: the account always names them.
            "thread_cpu_s": {k: v for k, v in cpu.items() if v > 0.001 or k.startswith("datastates-")}}


# --------------------------------------------------------------------------------------------- parent


def _run_child(mode: str, rounds_n: int, size_gb: float, iters: int, directory: str,
               stage_off: str | None = None, tensor_mb: float = 64.0) -> dict:
    cmd = [sys.executable, "-m", "megatron_ext.bench.python_loop_bench", "--child", mode, "--rounds-n", str(rounds_n),
           "--size-gb", str(size_gb), "--iters", str(iters), "--dir", directory, "--tensor-mb", str(tensor_mb)]
    if stage_off is not None:
        cmd += ["--stage-off", stage_off]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default per rank: torch copies on one core
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    shutil.rmtree(directory, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python-loop child {mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _steady(values: list[float], warmup: int) -> float:
    """Median of the iterations after the first ``warmup`` (the first saves allocate and spawn)."""
    kept = values[warmup:] if len(values) > warmup else values
    return statistics.median(kept)


def run(size_gb: float = 0.25, work_s: float = 0.8, iters: int = 8, repeats: int = DEFAULT_REPEATS, warmup: int = 2,
        modes: tuple[str, ...] = MODES, account: bool = False, directory: str | None = None,
        tensor_mb: float = 64.0) -> dict:
    from megatron_ext.bench import torch_checkpointing_peer
    from megatron_ext.bench.common import working_dir

    skipped: dict[str, str] = {}
    if "torch_checkpointing" in modes and torch_checkpointing_peer.missing():
        skipped["torch_checkpointing"] = torch_checkpointing_peer.missing()
        modes = tuple(m for m in modes if m != "torch_checkpointing")
    with working_dir(directory, "megatron-ext-bench-") as base:
        rounds_n = calibrate(work_s)
        result: dict = {"size_gb": size_gb, "work_s": work_s, "python_work_rounds": rounds_n, "iters": iters,
                        "repeats": repeats, "warmup_iters": warmup, "tensor_mb": tensor_mb,
                        "loadavg_start": os.getloadavg()[0], "load_average_before": list(os.getloadavg())}
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        variants = [(m, None) for m in modes]
        if account:
            variants += [("datastates", s) for s in STAGES]
            runs.update({f"datastates_no_{s}": [] for s in STAGES})
        for r in range(repeats):
            for mode, stage in round_order(variants, r):
                key = mode if stage is None else f"{mode}_no_{stage}"
                if key in skipped:
                    continue
                _progress(f"round {r + 1}/{repeats}: {key}")
                try:
                    runs[key].append(_run_child(mode, rounds_n, size_gb, iters, os.path.join(base, key), stage,
                                                tensor_mb))
                except RuntimeError as exc:
                    if mode not in PEERS:
                        raise
                    skipped[key] = f"round {r + 1}: {str(exc).strip().splitlines()[-1]}"
                    _progress(f"{key} skipped: {skipped[key]}")
        for key in skipped:
            runs.pop(key, None)
        for key, outs in runs.items():
            for figure in ("iter_s", "blocked_s", "offcpu_s"):
                result.update(figure_over_rounds(f"{figure}_{key}", [_steady(o[figure], warmup) for o in outs]))
            result[f"iter_s_{key}_rounds"] = result[f"iter_s_{key}_by_round"]  # the name before issue 56
            cpu: dict[str, float] = {}
            for o in outs:
                for name, seconds in o["thread_cpu_s"].items():
                    cpu[name] = cpu.get(name, 0.0) + seconds / iters / len(outs)
            result[f"thread_cpu_s_per_iter_{key}"] = {k: round(v, 4) for k, v in sorted(cpu.items())}
        none = result["iter_s_none"]
        for key in runs:
            if key != "none":
                result[f"ratio_{key}"] = result[f"iter_s_{key}"] / none
                # Each round's ratio to the no-checkpoint run of the same round (``none`` and
                # ``datastates`` always run back to back): less moved by the machine's drift.
                paired = figure_over_rounds(f"ratio_{key}", [a / b for a, b in zip(
                    result[f"iter_s_{key}_by_round"], result["iter_s_none_by_round"])])
                result[f"ratio_{key}_per_round"] = paired.pop(f"ratio_{key}")
                result.update(paired)
        dcp = [result[f"iter_s_{m}"] for m in ("dcp_async", "dcp_stager", "dcp_process") if m in runs]
        if "datastates" in runs and dcp:
            result["ratio_datastates_vs_best_dcp"] = result["iter_s_datastates"] / min(dcp)
        if "datastates" in runs and "torch_checkpointing" in runs:
            result["ratio_datastates_vs_torch_checkpointing"] = (result["iter_s_datastates"]
                                                                 / result["iter_s_torch_checkpointing"])
        result["skipped"] = skipped
        if account:  # from the off-CPU times: measured inside each process, so not moved by the machine's drift
            full = result["offcpu_s_datastates"]
            result["gil_account_s_per_iter"] = {
                "total": full - result["offcpu_s_none"], **{s: full - result[f"offcpu_s_datastates_no_{s}"]
                                                            for s in STAGES}}
        result["loadavg_end"] = os.getloadavg()[0]
        result["load_average_after"] = list(os.getloadavg())
        return result


def format_table(r: dict) -> str:
    lines = [f"{r['size_gb']} GB saved every iteration, {r['work_s']} s of pure-Python work per iteration, "
             f"median of {r['repeats']} rounds (load {r['loadavg_start']:.1f} -> {r['loadavg_end']:.1f})",
             f"  {'mode':<26} {'iteration':>10} {'vs none':>8} {'per round':>10} {'blocked':>9} {'off-CPU':>9}"]
    for key in [k[len("iter_s_"):] for k in r if k.startswith("iter_s_")
                and not k.endswith(("_rounds", "_by_round", "_spread"))]:
        ratio, paired = r.get(f"ratio_{key}"), r.get(f"ratio_{key}_per_round")
        lines.append(f"  {key:<26} {r['iter_s_' + key]:>9.3f}s {'' if ratio is None else f'{ratio:>7.3f}x':>8}"
                     f" {'' if paired is None else f'{paired:>8.3f}x':>10}"
                     f" {r['blocked_s_' + key] * 1e3:>7.1f}ms {r['offcpu_s_' + key] * 1e3:>7.1f}ms")
    if "gil_account_s_per_iter" in r:
        acc = r["gil_account_s_per_iter"]
        lines.append("  training thread's off-CPU time per iteration, by engine part (engine less that part): "
                     + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in acc.items()))
    for mode, reason in r.get("skipped", {}).items():
        lines.append(f"  {mode}: not run: {reason}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> str:
    from megatron_ext.bench.plots import grouped_bars

    keys = [m for m in MODES if f"ratio_{m}" in r]
    labels = {"datastates": "datastates", "dcp_async": "DCP async (thread)", "dcp_stager": "DCP + DefaultStager",
              "dcp_process": "DCP async (process)", "torch_checkpointing": "torch_checkpointing"}
    series = {labels[k]: [r[f"ratio_{k}"]] for k in keys}
    return grouped_bars(path, f"Python-bound loop, {r['size_gb']} GB saved per iteration: iteration time vs none",
                        [f"{r['work_s']} s Python work"], series, "iteration time / no checkpoint")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``megatron-ext bench python-loop``."""
    p.add_argument("--size-gb", type=POSITIVE, default=0.25, help="state saved every iteration, in GB (default 0.25)")
    p.add_argument("--tensor-mb", type=POSITIVE, default=64.0,
                   help="size of each saved tensor in MiB (default 64; e.g. 2 for a Megatron-like count of tensors)")
    p.add_argument("--work-s", type=POSITIVE, default=0.8,
                   help="seconds of pure-Python work per iteration, calibrated once (default 0.8)")
    p.add_argument("--iters", type=number(int, 2), default=8, help="iterations per run (default 8)")
    p.add_argument("--warmup", type=NONNEG_INT, default=2, help="first iterations of each run left out (default 2)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=DEFAULT_REPEATS,
                   help="rounds, each running every mode in a fresh process, order reversed every other round "
                        f"(default {DEFAULT_REPEATS})")
    p.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="none datastates dcp_async dcp_stager dcp_process torch_checkpointing (default: all)")
    p.add_argument("--account", action="store_true",
                   help="also the GIL account: the engine with its copies off, its commit off, or its flush in this "
                        "process instead of the I/O worker, one at a time, and each thread's CPU per iteration")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the ratios as a bar chart")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    if args.modes is None:
        args.modes = list(MODES)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}: choose among {' '.join(MODES)}")
    if "none" not in args.modes:
        args.modes = ["none", *args.modes]  # the ratios need the baseline
    result = run(args.size_gb, args.work_s, args.iters, args.repeats, args.warmup, tuple(args.modes), args.account,
                 args.dir, args.tensor_mb)
    if args.plot:
        result["plot"] = plot(result, args.plot)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_table(result))
    return 0


def _child_main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True, choices=MODES)
    p.add_argument("--rounds-n", type=int, required=True)
    p.add_argument("--size-gb", type=float, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--stage-off", default=None, choices=STAGES)
    p.add_argument("--tensor-mb", type=float, default=64.0)
    a = p.parse_args()
    out = child(a.child, a.rounds_n, a.size_gb, a.iters, a.dir, a.stage_off, a.tensor_mb)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    code = _child_main()
    sys.stderr.flush()
    # Every save has completed (``close``); skip the interpreter's teardown, where DCP's executor and
    # gloo threads still alive can abort the process ("terminate called without an active exception").
    os._exit(code)
