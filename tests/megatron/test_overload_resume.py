"""--datastates-overload-policy supersede on the reference trainer, writes throttled: resume bit-exact.

Two CPU ranks checkpoint every iteration onto a file system throttled far below what that needs,
so checkpoints are skipped, while the age bound forces a commit every few iterations (without it a
fast loop can skip every checkpoint before the crash). The run is SIGKILLed after iteration
CRASH_AT's save. The restart loads the newest committed checkpoint and every iteration it repeats
must reproduce the first run's loss and learning rate bit for bit. No skipped checkpoint may be
committed; every committed one verifies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.trainer_runs import run_trainer

pytest.importorskip("megatron.core")

ITERS = 12
CRASH_AT = 10
MAX_AGE = 3  # the age bound forces a commit at least every few iterations, however fast the loop


@pytest.mark.multiproc
def test_supersede_under_throttled_writes_resumes_bit_exact(tmp_path: Path):
    from megatron_ext.engine.read.verify import verify_root

    ckpt = tmp_path / "ckpt"
    common = ["--train-iters", str(ITERS)]
    datastates = ["--save", str(ckpt), "--save-interval", "1", "--use-datastates",
                  "--datastates-host-cache-size", "0.0015", "--datastates-overload-policy", "supersede",
                  "--throttle-writes-mbps", "1",
                  "--datastates-max-durable-age", str(MAX_AGE)]
    first = {r["iteration"]: (r["loss"], r["lr"]) for r in run_trainer(
        2, [*common, *datastates, "--crash-at-iteration", str(CRASH_AT)], tmp_path / "first.jsonl", expect_crash=True)}
    assert sorted(first) == list(range(1, CRASH_AT + 1))

    records = [json.loads(line) for r in range(2)
               for line in (ckpt / "datastates_telemetry" / f"rank-{r:05d}.jsonl").read_text().splitlines()]
    skipped = {r["checkpoint"] for r in records if r["event"] == "skipped"}
    committed = sorted(p.name for p in ckpt.iterdir() if (p / "manifest.json").exists())
    assert skipped, "the throttled writer should force skips"
    assert committed and not skipped & set(committed)
    checked, problems = verify_root(str(ckpt))
    assert checked == committed and not problems, problems
    newest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    # The tracker names a committed checkpoint; it lags the newest manifest by one commit at most,
    # when the SIGKILL fell between rank 0's manifest and its tracker update (the loader follows the tracker).
    newer = [name for name in committed if name > f"iter_{newest:07d}"]
    assert f"iter_{newest:07d}" in committed and len(newer) <= 1 and newest < CRASH_AT, (newest, committed)

    resumed = {r["iteration"]: (r["loss"], r["lr"]) for r in run_trainer(
        2, [*common, *datastates, "--load", str(ckpt)], tmp_path / "resumed.jsonl")}
    assert sorted(resumed) == list(range(newest + 1, ITERS + 1)), "iteration counter not restored"
    for it in range(newest + 1, CRASH_AT + 1):
        assert resumed[it] == first[it], f"iteration {it}: (loss, lr) {resumed[it]} != {first[it]}"
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == ITERS  # the last save is kept
