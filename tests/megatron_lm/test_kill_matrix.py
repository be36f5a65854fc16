"""A SIGKILL of the whole job at each named moment of a save, in Megatron-LM's own loop (2 ranks).

Every trial trains with ``--use-datastates --save-interval 1``, a node-local level and keep-last-2
retention, and arms one stop point of the engine (``faults.STOP_POINTS``): the n-th time a process
of the job reaches it, that process writes a marker and waits; the test then SIGKILLs every process
of the job (ranks, their I/O workers, torchrun), as a node failure would. Then:

* every checkpoint with a manifest verifies (``megatron-ext verify``): nothing is committed that
  would not load;
* the restart resumes from the newest committed checkpoint and its steps, with the killed run's,
  are bit for bit the uninterrupted run's;
* once the restarted run ends, both levels hold only committed checkpoints and the tracker: what
  the crash left half-written, the restart removed.

The default suite runs two points; ``--run-slow`` runs every point at two arrivals each.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from helpers.megatron_lm_runs import DATASTATES, STEP_FIELDS, assert_same_trajectory, run, trajectory
from helpers.procs import child_env, kill_job, python_command, warm_command
from megatron_ext.engine.faults import STOP_DIR_ENV, STOP_ENV, STOP_POINTS
from megatron_ext.engine.save.lifecycle.lock import LOCK_FILE
from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE
from megatron_ext.testing import megatron_lm

ITERS = 6
NPROC = 2
COMMON = ["--bf16", "--use-distributed-optimizer", "--save-interval", "1", "--train-iters", str(ITERS)]
STOP_TIMEOUT_S = 300
#: What a level holds besides its checkpoints in any run: the tracker, the writer's lock, the telemetry.
RUN_FILES = {TRACKER_FILE, LOCK_FILE, "datastates_telemetry"}
#: (point, arrival) the default suite runs: the data half-written, and an old checkpoint out of sight
#: but not yet deleted (which found the node-local level's missing sweep).
DEFAULT = [("mid_flush", 2), ("mid_retention", 1)]
#: Every point at two arrivals (``--run-slow``); retention first removes at the third commit.
MATRIX = [(point, n) for point in STOP_POINTS for n in ((1, 2) if point == "mid_retention" else (2, 3))]


def _levels(tmp: Path) -> list[str]:
    return ["--save", str(tmp / "shared"), "--load", str(tmp / "shared"), *DATASTATES,
            "--datastates-local-dir", str(tmp / "local"), "--datastates-keep-last", "2"]


@pytest.fixture(scope="module")
def uninterrupted(checkout, tmp_path_factory) -> dict[int, tuple]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    return trajectory(run(checkout, NPROC, [*COMMON, *_levels(tmp)], tmp, "uninterrupted"))


def _killed_at(checkout: Path, tmp: Path, point: str, arrival: int) -> subprocess.CompletedProcess | None:
    """The job, stopped where ``point`` is reached the ``arrival``-th time in one of its processes, then
    SIGKILLed whole; returns the steps it recorded. Fails if the job ends without reaching it."""
    markers = tmp / "markers"
    markers.mkdir(parents=True)
    record = tmp / "killed.jsonl"
    cmd = warm_command(megatron_lm.torchrun_command(NPROC, [*megatron_lm.TINY_GPT, *COMMON, *_levels(tmp)], checkout,
                                                    record=str(record)))
    env = dict(megatron_lm.environment(), **{STOP_ENV: f"{point}@{arrival}", STOP_DIR_ENV: str(markers)})
    with open(tmp / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while not any(markers.iterdir()):
                if proc.poll() is not None:
                    pytest.fail(f"{point}@{arrival}: the job ended (exit code {proc.returncode}) without reaching "
                                f"the point\n{(tmp / 'killed.log').read_text(errors='replace')[-4000:]}")
                assert time.monotonic() < deadline, f"{point}@{arrival}: not reached in {STOP_TIMEOUT_S}s"
                time.sleep(0.02)
        finally:
            kill_job(proc)
    return megatron_lm.read_records(record)


def _committed(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists()) if root.exists() else []


def _verify(root: Path) -> None:
    if not _committed(root):
        return
    proc = subprocess.run(python_command("-m", "megatron_ext", "verify", str(root)), capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert proc.returncode == 0, f"a committed checkpoint under {root} does not verify:\n{proc.stdout}\n{proc.stderr}"


def _leftovers(root: Path, shared: Path) -> list[str]:
    """What a level holds besides ``RUN_FILES`` and checkpoints committed on the shared level (the local
    level keeps no manifest of its own); inside those, hidden entries (temporary files, renamed-away
    attempts) besides their ``.reports``."""
    committed = set(_committed(shared))
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name in RUN_FILES:
            continue
        if entry.name not in committed or not entry.is_dir():
            found.append(entry.name)
            continue
        found += [f"{entry.name}/{inner.name}" for inner in entry.iterdir()
                  if inner.name.startswith(".") and inner.name != ".reports"]
    return found


def _trial(checkout: Path, tmp: Path, point: str, arrival: int, uninterrupted: dict[int, tuple]) -> dict:
    killed = _killed_at(checkout, tmp, point, arrival)
    marker = next((tmp / "markers").iterdir()).name
    for level in ("shared", "local"):
        _verify(tmp / level)
    tracker = tmp / "shared" / TRACKER_FILE
    committed = int(tracker.read_text()) if tracker.exists() else 0
    resumed = run(checkout, NPROC, [*COMMON, *_levels(tmp)], tmp, "resumed")
    steps = {r["iteration"]: tuple(r.get(f) for f in STEP_FIELDS) for r in killed}
    steps.update(trajectory(resumed))
    assert_same_trajectory(dict(sorted(steps.items())), uninterrupted, f"{point}@{arrival}: killed + resumed")
    assert resumed.first_iteration is not None and resumed.first_iteration <= committed + 1
    for level in ("shared", "local"):
        assert _leftovers(tmp / level, tmp / "shared") == [], f"{point}@{arrival}: left under {level} after the restart"
    assert (tmp / "shared" / TRACKER_FILE).read_text().strip() == str(ITERS)
    return {"point": point, "arrival": arrival, "stopped": marker, "tracker_at_kill": committed,
            "resumed_from": resumed.first_iteration - 1}


@pytest.mark.parametrize("point, arrival", DEFAULT, ids=[f"{p}@{n}" for p, n in DEFAULT])
def test_kill_matrix_default_points(checkout, tmp_path, uninterrupted, point, arrival):
    print(_trial(checkout, tmp_path, point, arrival, uninterrupted))


@pytest.mark.slow
@pytest.mark.parametrize("point, arrival", [t for t in MATRIX if t not in DEFAULT],
                         ids=[f"{p}@{n}" for p, n in MATRIX if (p, n) not in DEFAULT])
def test_kill_matrix_every_point(checkout, tmp_path, uninterrupted, point, arrival):
    print(_trial(checkout, tmp_path, point, arrival, uninterrupted))
