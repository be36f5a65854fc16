"""Megatron-LM's own ``pretrain_gpt.py`` runs for the differential tests: ours against Megatron's.

A *scenario* is a list of phases (runs of the same job: the first may be killed, later ones
resume); it runs once with ``--use-datastates`` and once with Megatron-LM's own ``torch_dist``
checkpointing, and the two per-iteration trajectories (loss, grad norm, learning rate, skipped
flag) must be identical, bit for bit. A resumed run repeats the iterations after its checkpoint;
those repeats must equal the first execution too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE
from megatron_ext.testing import megatron_lm

from helpers.procs import warm_command

RUN_TIMEOUT_S = 600
DATASTATES = ["--use-datastates", "--datastates-host-cache-size", "0.05"]
NATIVE = ["--ckpt-format", "torch_dist"]
# The fields of a step compared bit for bit between runs.
STEP_FIELDS = ("loss", "grad_norm", "lr", "skipped", "loss_scale", "consumed_train_samples")


@dataclasses.dataclass
class Phase:
    """One run of the job. ``kill_at``: every rank SIGKILLs itself after that iteration's save call."""

    args: list[str]
    kill_at: int | None = None
    expect_failure: bool = False
    sigterm_at: int | None = None  # SIGTERM to every rank after that iteration's step
    expire_at: int | None = None  # the training clock jumps a day after that iteration's step
    late_copies: bool = False  # each snapshot's copies start only at the optimizer's wait
    # With kill_at: that iteration's save waits until this iteration (or a later one) is committed.
    committed_before_kill: int | None = None


@dataclasses.dataclass
class RunResult:
    records: list[dict]
    log: str
    returncode: int

    @property
    def first_iteration(self) -> int | None:
        return self.records[0]["iteration"] if self.records else None


def without_flags(flags: list[str], *names: str) -> list[str]:
    """``flags`` without the named options and their values."""
    return [a for i, a in enumerate(flags) if a not in names and (i == 0 or flags[i - 1] not in names)]


def run(checkout: Path, nproc: int, args: list[str], workdir: Path, name: str, kill_at: int | None = None,
        expect_failure: bool = False, model: list[str] = megatron_lm.TINY_GPT,
        sigterm_at: int | None = None, expire_at: int | None = None, late_copies: bool = False,
        committed_before_kill: int | None = None, script: str = "pretrain_gpt.py",
        exit_at: int | None = None, record_logits: Path | None = None,
        inprocess_fault_at: int | None = None, ft_launcher: list[str] | None = None,
        record_ft: Path | None = None, env: dict | None = None) -> RunResult:
    """One torchrun of ``script`` (``pretrain_gpt.py``); fails the test (with the log's tail) on an unexpected
    exit code. ``ft_launcher``: under nvidia-resiliency-ext's launcher with these options instead (a cold
    start: the session's zygote serves torchrun only); ``env``: added to the run's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    record = workdir / f"{name}.jsonl"
    record.unlink(missing_ok=True)
    cmd = warm_command(megatron_lm.torchrun_command(nproc, [*model, *args], checkout, record=str(record),
                                                    kill_at=kill_at, sigterm_at=sigterm_at, expire_at=expire_at,
                                                    late_copies=late_copies,
                                                    committed_before_kill=committed_before_kill, script=script,
                                                    exit_at=exit_at, record_logits=record_logits,
                                                    inprocess_fault_at=inprocess_fault_at,
                                                    ft_launcher=ft_launcher, record_ft=record_ft))
    log_path = workdir / f"{name}.log"
    environment = megatron_lm.environment(nvrx=ft_launcher is not None)
    returncode = run_to_completion(cmd, {**environment, **(env or {})}, log_path, RUN_TIMEOUT_S)
    log = log_path.read_text(errors="replace")
    if (returncode != 0) != (kill_at is not None or expect_failure):
        pytest.fail(f"{name}: exit code {returncode} (expected {'failure' if kill_at or expect_failure else 0})"
                    f"\n$ {' '.join(cmd)}\n--- log tail ---\n{_tail(log)}")
    return RunResult(megatron_lm.read_records(record), log, returncode)


def run_to_completion(cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> int:
    """Run ``cmd`` in a session of its own, output to ``log_path``; whatever it leaves behind is killed.

    A timeout kills the whole session and says so in the log (returned as -9).
    """
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.write(f"\n[test] timed out after {timeout_s:.0f}s: killing the job\n")
            returncode = -9
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return returncode


def _tail(log: str, lines: int = 60) -> str:
    keep = [line for line in log.splitlines() if "....." not in line]  # Megatron's argument dump
    return "\n".join(keep[-lines:])


def trajectory(*runs: RunResult) -> dict[int, tuple]:
    """Iteration -> the step's compared fields, over runs in order; repeated iterations must agree."""
    steps: dict[int, tuple] = {}
    for result in runs:
        for record in result.records:
            step = tuple(record.get(field) for field in STEP_FIELDS)
            seen = steps.setdefault(record["iteration"], step)
            assert seen == step, (f"iteration {record['iteration']} ran twice with different results: "
                                  f"{dict(zip(STEP_FIELDS, seen))} then {dict(zip(STEP_FIELDS, step))}")
    return dict(sorted(steps.items()))


def read_tracker(save_dir: Path) -> str | None:
    path = save_dir / TRACKER_FILE
    return path.read_text().strip() if path.exists() else None


@dataclasses.dataclass
class ScenarioResult:
    runs: list[RunResult]
    trajectory: dict[int, tuple]
    save_dir: Path
    trackers: list[str | None]  # the tracker after each phase


def run_scenario(checkout: Path, nproc: int, phases: list[Phase], workdir: Path, checkpointing: list[str],
                 common: list[str], save_dir: Path | None = None,
                 model: list[str] = megatron_lm.TINY_GPT) -> ScenarioResult:
    """Run the phases in order with one save/load directory; ``checkpointing`` selects ours or Megatron's."""
    save_dir = save_dir or workdir / "ckpt"
    runs, trackers = [], []
    for n, phase in enumerate(phases):
        args = [*common, "--save", str(save_dir), "--load", str(save_dir), *checkpointing, *phase.args]
        runs.append(run(checkout, nproc, args, workdir, f"phase{n}", phase.kill_at, phase.expect_failure, model,
                        phase.sigterm_at, phase.expire_at, phase.late_copies, phase.committed_before_kill))
        trackers.append(read_tracker(save_dir))
    return ScenarioResult(runs, trajectory(*runs), save_dir, trackers)


def assert_same_trajectory(ours: dict[int, tuple], theirs: dict[int, tuple], what: str) -> None:
    """Bit-identical steps, iteration by iteration, with the first difference spelled out."""
    assert list(ours) == list(theirs), f"{what}: iterations {list(ours)} vs {list(theirs)}"
    for iteration in ours:
        if ours[iteration] != theirs[iteration]:
            diff = {f: (a, b) for f, a, b in zip(STEP_FIELDS, ours[iteration], theirs[iteration]) if a != b}
            pytest.fail(f"{what}: iteration {iteration} differs (ours, theirs): {diff}")


def copy_checkpoints(source: Path, target: Path) -> Path:
    """A copy of a save directory, for a second scenario starting from the same checkpoints."""
    shutil.copytree(source, target, symlinks=True)
    return target


def checkout_or_skip() -> Path:
    checkout, reason = megatron_lm.find_checkout()
    if checkout is None:
        pytest.skip(reason)
    return checkout


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def saved_tensor(save_dir: Path, iteration: int, key: str, datastates: bool) -> torch.Tensor:
    """The whole tensor ``key`` of a checkpoint, from ours (the shards that tile it) or from torch_dist's."""
    directory = save_dir / f"iter_{iteration:07d}"
    if datastates:
        from megatron_ext.megatron.export import open_iteration
        from megatron_ext.megatron.shard_assembly import SavedShards

        shards = SavedShards(open_iteration(str(save_dir), iteration))
        shape = tuple(shards.global_shape(key))
        return shards.read_shard(key, (0,) * len(shape), shape, 0, None)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = directory.parent / f".{directory.name}.{key}.pt"
    dcp_to_torch_save(str(directory), str(flat))
    try:
        return torch.load(flat, weights_only=False)[key]
    finally:
        flat.unlink()


def assert_same_saved_tensors(ours: Path, theirs: Path, keys: list[str], what: str) -> list[int]:
    """``keys`` bit-identical in every iteration both save directories committed; returns those iterations."""
    common = sorted(int(p.name[5:]) for p in ours.glob("iter_*") if (p / "manifest.json").exists()
                    and (theirs / p.name / "metadata.json").exists())
    assert common, f"{what}: no iteration saved by both"
    for iteration in common:
        for key in keys:
            mine, native = (saved_tensor(d, iteration, key, d is ours) for d in (ours, theirs))
            assert torch.equal(mine, native.to(mine.dtype)), (
                f"{what}: iteration {iteration} saved a different {key}: max difference "
                f"{(mine.float() - native.float()).abs().max().item()}")
    return common
