"""``megatron-ext export`` of DeepSpeed checkpoints saved with ``datastates_ckpt`` (2 CPU ranks, gloo).

The oracle is DeepSpeed's own ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``) run
on the checkpoint DeepSpeed's default engine wrote in an identical run (same seed, same steps:
DeepSpeed's training is deterministic here, tests/deepspeed/test_deepspeed_resume.py). The
exported weights must equal its fp32 state dict bit for bit, for ZeRO 1, 2 and 3 (0 with
``--run-slow``). DeepSpeed's copy of that script cannot read this project's files (the failure a
user meets first), and DeepSpeed runs write telemetry under their save directory by default.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers.procs import REPO, child_env, python_command
from test_deepspeed_resume import run_harness

pytest.importorskip("deepspeed")

STEPS = 2


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(python_command("-m", "megatron_ext", "export", *args), cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.multiproc
# ZeRO 1 (optimizer partitions) and 3 (parameter partitions) by default; 0 and 2 (1's layout plus
# gradient partitions, the same files) with --run-slow, to keep the default run near 30 minutes.
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 1,
                                   pytest.param(2, marks=pytest.mark.slow), 3])
def test_export_equals_deepspeeds_own_zero_to_fp32(tmp_path, stage):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    common = ["--zero-stage", str(stage), "--steps", str(STEPS)]
    ours, theirs = tmp_path / "datastates", tmp_path / "torch"
    run_harness([*common, "--engine", "datastates", "--save-dir", str(ours)], tmp_path / "ours.jsonl")
    run_harness([*common, "--engine", "torch", "--save-dir", str(theirs)], tmp_path / "theirs.jsonl")
    tag = (ours / "latest").read_text().strip()  # the newest committed tag
    # Every stage: the harness ends with engine.destroy(), whose wait(persist=True) commits the last tag
    # (without ZeRO through the ranks' all-gather, which destroy runs on every rank together).
    assert tag == f"global_step{STEPS}"
    if stage:
        expected = get_fp32_state_dict_from_zero_checkpoint(str(theirs), tag=tag)
        expected = {k: (v.contiguous() if hasattr(v, "contiguous") else v) for k, v in expected.items()}
        # DeepSpeed's script, copied into every save directory, fails on this project's files.
        with pytest.raises(Exception, match="invalid load key"):
            get_fp32_state_dict_from_zero_checkpoint(str(ours), tag=tag)
    else:  # no ZeRO: the module's state dict as DeepSpeed saved it
        expected = torch.load(theirs / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]

    out = tmp_path / "weights"
    proc = _export(str(ours), "--to", "safetensors", str(out), "--json")  # the save directory: newest committed
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["kind"] == "deepspeed" and summary["checkpoint"].endswith(tag) and summary["zero_stage"] == stage
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / name))
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    bf16 = tmp_path / "bf16"  # the checkpoint's own directory; --dtype casts
    proc = _export(str(ours / tag), "--to", "safetensors", str(bf16), "--dtype", "bf16", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    cast = load_file(bf16 / "model-00001-of-00001.safetensors")
    assert all(cast[k].dtype == torch.bfloat16 and torch.equal(cast[k], expected[k].bfloat16()) for k in expected)

    # DeepSpeed names the directory only at save_checkpoint: telemetry goes under it by default.
    assert (ours / "datastates_telemetry" / "rank-00000.jsonl").exists()
    # Without ZeRO rank 1 saves nothing, so it never learns the directory (docs/DEEPSPEED.md, "Telemetry").
    assert (ours / "datastates_telemetry" / "rank-00001.jsonl").exists() == (stage > 0)
    events = [json.loads(line)["event"] for line in (ours / "datastates_telemetry" / "rank-00000.jsonl").open()]
    assert "snapshot" in events and "commit" in events
    # The pointer files DeepSpeed globs for say where the weights come from.
    pointer = json.loads(next((ours / tag).glob("*_model_states.pt")).read_text())
    assert "megatron-ext export" in pointer["note"]
    rows = json.loads(subprocess.run(python_command("-m", "megatron_ext", "inspect", str(ours), "--json"), cwd=REPO,
                                     env=child_env(), capture_output=True, text=True, timeout=120).stdout)
    assert [(r["checkpoint"], r["kind"], r["version"]) for r in rows if r["committed"]][-1] == (
        tag, "deepspeed", int(tag.removeprefix("global_step")))
