"""``bench offload`` on a CPU: every variant gives the same bits, the JSON has its figures, and the
bench imports no megatron-core (it must run on a bare GPU node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from megatron_ext.bench import offload_bench

REPO = Path(__file__).resolve().parents[2]


def test_small_run_on_cpu_is_bit_identical_across_variants():
    result = offload_bench.run(20_000, torch.device("cpu"), steps=2, warmup=1, subgroup_numel=4096,
                               fractions=[0.25], strides=[2], tokens=10, checkpoint=True, repeats=2)
    names = [v["variant"] for v in result["variants"]]
    assert names == ["all-gpu", "hdo-1.0", "static-0.25", "interleaved-model", "interleaved-stride-2"]
    assert all(result["bit_identical_to_first"].values()), result["bit_identical_to_first"]
    for v in result["variants"]:
        assert v["update_s"] > 0 and v["params_per_s"] > 0 and v["checkpoint_s"] is not None
        assert v["h2d_gbps"] is not None and v["d2h_gbps"] is not None
        assert len(v["update_s_by_round"]) == 2 and v["update_s_spread"] >= 0 and v["variant"] in names
    by_name = {v["variant"]: v for v in result["variants"]}
    assert by_name["interleaved-stride-2"]["gpu_subgroup_share"] == 3 / 5  # subgroups 0, 2, 4 of 5
    assert by_name["interleaved-model"]["predicted_update_s"] > 0
    assert by_name["hdo-1.0"]["predicted_update_s"] > 0


def test_the_command_prints_a_table_or_with_json_one_object(capsys):
    from megatron_ext.cli import main as cli_main

    argv = ["bench", "offload", "--params", "20000", "--steps", "1", "--warmup", "0", "--fractions", "0.5",
            "--strides", "2", "--repeats", "1"]
    assert cli_main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["params"] == 20000 and all(result["bit_identical_to_first"].values())
    assert cli_main(argv) == 0
    table = capsys.readouterr().out
    assert "variant" in table and all(v["variant"] in table for v in result["variants"])


def test_the_bench_imports_no_megatron_core():
    code = ("import sys, megatron_ext.bench.offload_bench; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == []
