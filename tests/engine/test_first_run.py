"""What a new user runs first, as docs/ENGINE.md and the demo show it: the engine example on a first and a
second run, ``load(None)``, ``load_into`` a model that is not the saved one, the demo's messages, and
docs/MEGATRON.md's table of Megatron-LM flags against the flags the adapter defines."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from helpers.procs import REPO, child_env, python_command
from megatron_ext.engine import CheckpointEngine, CheckpointError

ENGINE_DOC = (REPO / "docs" / "ENGINE.md").read_text()
MEGATRON_DOC = (REPO / "docs" / "MEGATRON.md").read_text()


def _engine_example() -> str:
    section = ENGINE_DOC.split("## Using the engine", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_engine_example_runs_as_written_twice(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_engine_example())
    runs = [subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (run.stdout for run in runs)
    assert "resumed from" not in first and "trained steps 0-19; newest committed: step_0000019" in first
    assert "resumed from step_0000019" in second and "newest committed: step_0000019" in second
    assert (tmp_path / "runs" / "engine-example" / "ckpt" / "step_0000019" / "manifest.json").exists()


def test_load_none_says_there_is_no_checkpoint_yet(tmp_path):
    with CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        assert engine.latest() is None
        for call in (lambda: engine.load(engine.latest()), lambda: engine.load_into(None, {}),
                     lambda: engine.open_checkpoint(None)):
            with pytest.raises(CheckpointError, match="none is committed under .* yet .*if latest is not None"):
                call()


def test_load_into_another_model_says_the_template_is_not_the_saved_model(tmp_path):
    with CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.001}, rank=0, world_size=1) as engine:
        engine.save({"model": torch.nn.Linear(4, 8).state_dict()}, "step_1", version=1)
        engine.commit("step_1")
        engine.wait_persisted()
        with pytest.raises(CheckpointError, match=r"F32\[8\] in the checkpoint, the target is torch.float32\[16\]: "
                                                  r"the template is not the model that was saved"):
            engine.load_into("step_1", {"model": torch.nn.Linear(4, 16).state_dict()})


def test_demo_says_what_it_trained_and_where_the_checkpoints_are(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(python_command("-m", "megatron_ext", "demo", "--out", str(out), "--steps", "6"), cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "reference: trained steps 1-6 without checkpoints" in text
    assert f"run 1: trained steps 1-3 of 6 with a checkpoint after every step (step_0000001 ... step_0000003 in {out})" in text
    assert f"run 2: resumed from {out / 'step_0000003'} (step 3" in text and "training steps 4-6" in text
    assert f"checkpoints: {out} (step_0000001 ... step_0000006)" in text and f"megatron-ext inspect {out}" in text
    assert sorted(p.name for p in out.glob("step_*")) == [f"step_{i:07d}" for i in range(1, 7)]
    proc = subprocess.run(python_command("-m", "megatron_ext", "demo", "--out", str(out), "--steps", "2", "--json"),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON alone; the progress lines went to stderr
    assert result["ok"] and result["losses_bit_identical"] and result["resumed_from"] == "step_0000001"
    assert "[demo] run 2: resumed from" in proc.stderr


def test_readme_flag_table_lists_every_datastates_flag():
    import argparse

    from megatron_ext.megatron.args import add_datastates_args

    parser = add_datastates_args(argparse.ArgumentParser())
    flags = [o for action in parser._actions for o in action.option_strings if o.startswith("--datastates-")
             or o == "--use-datastates"]
    table = MEGATRON_DOC.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", table)]
    assert not missing, f"docs/MEGATRON.md's flag table lacks {missing}"
    assert len(flags) >= 16


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    import io

    from megatron_ext.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    with Progress("export", stream=tty) as progress:
        progress.total_bytes, progress.total_files = 3_000_000_000, 3  # known once planned
        progress.update(1_000_000_000, 1)
        progress.update(2_000_000_000, 2)
    text = tty.getvalue()
    assert "\r" in text and "3/3 files" in text and "3.00G/3.00G" in text  # tqdm's bar, files beside it
    assert text.rstrip().splitlines()[-1].startswith("export: done: 3/3 files, 3.00/3.00 GB, ")

    log = io.StringIO()  # a job log: a line per interval, with rate and ETA, and the last one
    progress = Progress("verify", 4_000_000, 4, stream=log, interval=0)
    progress.update(1_000_000, 1)
    progress.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("verify: 1/4 files, 1.0/4.0 MB, ") and "B/s, ETA " in lines[0]
    assert lines[-1].startswith("verify: done: 1/4 files") and "ETA" not in lines[-1]
    quiet = io.StringIO()
    with Progress("verify", 1, 1, stream=quiet, quiet=True, interval=0) as progress:
        progress.update(1, 1)
    assert quiet.getvalue() == ""
    failed = io.StringIO()  # a failure within the interval leaves the error line alone on stderr
    with pytest.raises(RuntimeError):
        with Progress("convert", 10, 1, stream=failed) as progress:
            raise RuntimeError("bad checkpoint")
    assert failed.getvalue() == ""
