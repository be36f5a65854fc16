"""Every ``megatron-ext`` command turns bad input into one line on stderr and a non-zero exit, never
a traceback; ``verify`` and ``inspect`` take one checkpoint's directory as well as a root."""

from __future__ import annotations

import json

import pytest

from helpers.hostile import C1, C2, assert_one_line_error, cli_in_process, files_of, manifest_path, run_cli


def test_verify_and_inspect_accept_one_checkpoint_directory(genuine, capsys):
    one = cli_in_process(capsys, "verify", str(genuine / C2))
    assert one.returncode == 0 and f"OK   1 checkpoint(s) verified: {C2}" in one.stdout
    rows = json.loads(cli_in_process(capsys, "inspect", str(genuine / C2), "--json").stdout)
    assert [(r["checkpoint"], r["committed"], r["version"]) for r in rows] == [(C2, True, 2)]
    both = cli_in_process(capsys, "verify", str(genuine))
    assert both.returncode == 0 and f"2 checkpoint(s) verified: {C1}, {C2}" in both.stdout


def test_progress_on_stderr_and_json_on_stdout(genuine, capsys):
    """Commands that read many files report files, bytes, rate and time on stderr (not a terminal
    here: a plain last line), ``-q`` silences it, ``--json`` keeps stdout machine-readable."""
    done = cli_in_process(capsys, "verify", str(genuine), "--json")
    assert done.returncode == 0
    report = json.loads(done.stdout)
    assert report["ok"] and report["checked"] == [C1, C2] and report["problems"] == []
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("verify: done: 2/2 files, ") and " MB" in line and "/s, elapsed " in line
    quiet = cli_in_process(capsys, "verify", str(genuine), "-q")
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert cli_in_process(capsys, "-q", "verify", str(genuine)).stderr == ""
    manifest_path(genuine, C2).write_text("{}")
    bad = cli_in_process(capsys, "verify", str(genuine), "--json")
    report = json.loads(bad.stdout)
    assert bad.returncode == 1 and not report["ok"] and report["problems"][0]["checkpoint"] == C2


def test_bad_input_real_processes(genuine, tmp_path):
    """Spawned as a user would run them (two: each start costs seconds; the rest run in-process below)."""
    manifest_path(genuine, C2).write_text('{"format": "megatron_ext.datastates", "files": ')
    bad = run_cli("verify", str(genuine / C2))
    assert bad.returncode == 1 and "not valid JSON" in bad.stdout and "Traceback" not in bad.stderr
    assert_one_line_error(run_cli("export", str(genuine), "--iteration", "2", "--to", "safetensors", str(tmp_path / "o")),
                          "megatron-ext export: error:", "manifest.json: not valid JSON")


@pytest.mark.parametrize("args, needle", [
    (["verify", "{tmp}/nowhere"], "is not a directory"),
    (["verify", "{root}", "--iteration", "-1"], "argument --iteration: -1 must be >= 0"),
    (["verify", "{root}", "--checkpoint", "../x"], "'../x' is not a checkpoint name"),
    (["inspect", "{tmp}/nowhere"], "is not a directory"),
    (["export", "{root}", "--iteration", "7", "--to", "safetensors", "{tmp}/out"], "is not a committed datastates"),
    (["export", "{root}", "--iteration", "2", "--to", "safetensors", "{tmp}/out", "--max-shard-size", "lots"],
     "size 'lots'"),
    (["export", "{root}", "--iteration", "2", "--to", "safetensors", "{tmp}/out", "--max-shard-size", "100"],
     "a bare number is ambiguous; write 100B for bytes"),
    (["export", "{root}", "--iteration", "2", "--to", "safetensors", "{sidecar}"], "exists and is not an empty directory"),
    # A mistyped flag is named, not reported as a missing one.
    (["export", "{root}", "--iteraton", "2", "{tmp}/out"], "unrecognized arguments: --iteraton"),
    (["verify", "{root}", "--chekpoint", "x"], "unrecognized arguments: --chekpoint"),
    (["export", "{root}", "--checkpoint", "iter_0000002", "--to", "safetensors", "{tmp}/out", "--names", "hf"],
     "Hugging Face names (--to hf, --names hf) map Megatron GPT weights"),
    (["export", "{root}/iter_0000001", "--iteration", "2", "--to", "safetensors", "{tmp}/out"],
     "is checkpoint iter_0000001, but --iteration/--checkpoint asks for iter_0000002"),
    (["convert", "{root}", "--iteration", "2", "--to", "torch_dist", "{tmp}/out"], "not one the Megatron adapter saved"),
    (["convert", "{root}", "--to", "datastates", "{tmp}/out"], "no latest_checkpointed_iteration.txt"),
    (["convert", "{root}", "--iteration", "2", "--to", "datastates", "{tmp}/out"], "not a megatron-core distributed"),
    (["telemetry", "report", "{tmp}/nowhere.jsonl"], "no telemetry log"),
    (["telemetry", "report", "{sidecar}", "--out", "{tmp}/rep"], "no telemetry records"),
    (["demo", "--steps", "1"], "argument --steps: 1 must be >= 2"),
    (["demo", "--out", "{sidecar}"], "save_dir"),
    (["main-job", "--iters", "3", "--crash-at", "5"], "--crash-at 5 must lie in [1, --iters 3)"),
    (["bench", "engine", "--size-gb", "-1"], "argument --size-gb: -1 must be > 0"),
    (["bench", "restore", "--threads", "0"], "argument --threads: 0 must be >= 1"),
    (["bench", "train", "--nproc", "0"], "argument --nproc: 0 must be >= 1"),
    (["bench", "deepspeed", "--hidden", "nan"], "'nan' is not a whole number"),
    (["bench", "overload", "--compute-s", "inf"], "inf must be >= 0"),
    (["bench", "replica", "--ranks-per-node", "x"], "'x' is not a whole number"),
    (["bench", "suite", "--out", "{sidecar}"], "File exists"),
    (["nonsense"], "invalid choice: 'nonsense'"),
], ids=lambda v: " ".join(v)[:50] if isinstance(v, list) else None)
def test_bad_input_is_one_line(genuine, tmp_path, capsys, args, needle):
    sidecar = files_of(genuine, C2)[1]
    argv = [a.format(root=genuine, tmp=tmp_path, sidecar=sidecar) for a in args]
    assert_one_line_error(cli_in_process(capsys, *argv), "megatron-ext", needle)
