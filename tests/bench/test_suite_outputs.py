"""The benchmark suite's output writer on one real tiny scenario, and the GPU model's arithmetic."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.bench import gpu_model, suite
from megatron_ext.cli import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"


def test_size_scenario_writes_json_table_and_plot(tmp_path):
    base, out = tmp_path / "work", tmp_path / "out"
    limits = suite.measure_limits(str(base / "direct"), 4 << 20)
    sizes = suite.run_sizes((4,), str(base / "sizes"), suite.Progress(len(suite.SIZE_APPROACHES)))
    results = {"meta": {"profile": {"name": "test"}, "started": "now", "host": "here", "cpus": os.cpu_count(),
                        "note": suite.NOISE_NOTE},
               "sizes": sizes, "limits": {"before": limits, "after": limits, **limits}}
    results["gpu_model"] = suite.gpu_model_inputs(sizes, results["limits"])
    files = suite.write_outputs(results, str(out))

    assert files == ["results.json", "results.md", "throughput_by_size.png"]
    assert (out / "throughput_by_size.png").read_bytes()[:8] == PNG
    written = json.loads((out / "results.json").read_text())
    assert set(written) == {"meta", "sizes", "limits", "gpu_model"}
    assert [r["approach"] for r in written["sizes"]] == list(suite.SIZE_APPROACHES)
    for r in written["sizes"]:
        assert r["size_mb"] == 4 and r["size_bytes"] >= 4 << 20
        assert 0 < r["blocked_s"] <= r["done_s"]
        assert r["throughput_gbps"] == pytest.approx(r["size_bytes"] / r["blocked_s"] / 1e9)
    assert written["limits"]["memcpy_gbps"] > 0 and written["limits"]["direct_write_gbps"] > 0
    assert set(written["gpu_model"]["predictions"]) == {f"engine/{g}gpu/every{k}" for g in (180, 80) for k in (1, 10)}

    table = (out / "results.md").read_text()
    assert "| approach | 4 MB |" in table
    for r in sizes:
        assert f"| {r['approach']} | {r['throughput_gbps']:.2f} ({r['blocked_s']:.4f} / {r['done_s']:.2f}) |" in table
    assert "| engine | 180 | 1 |" in table and "DataStates 638 GB/s" in table


def test_gpu_model_formulae():
    a, b = gpu_model.fit_bookkeeping([1e9, 2e9, 3e9], [0.011, 0.021, 0.031])
    assert a == pytest.approx(0.001) and b == pytest.approx(1e-11)
    p = gpu_model.predict(a, b, flush_efficiency=0.5, gpus=180, interval=1)
    per_gpu = 1065e9 / 180
    assert p.nodes == 45 and p.per_gpu_gb == pytest.approx(per_gpu / 1e9)
    assert p.d2h_s == pytest.approx(per_gpu / 25e9) and p.d2h_stall_s == 0.0  # hidden under 23.53 s fwd+bwd
    assert p.flush_s == pytest.approx(1065e9 / 45 / (650e9 / 45 * 0.5))
    assert p.flush_stall_s == 0.0  # 3.3 s of flush per 23.65 s iteration
    assert p.stall_s == pytest.approx(a + b * per_gpu)
    assert p.overhead == pytest.approx(p.stall_s / 23.65)
    slow = gpu_model.predict(a, b, flush_efficiency=0.05, gpus=180, interval=1)
    assert slow.flush_stall_s == pytest.approx(slow.flush_s - 23.65)  # the flush no longer keeps up
    with pytest.raises(ValueError, match="do not fill nodes"):
        gpu_model.predict(a, b, 1.0, gpus=181)


@pytest.mark.slow
def test_quick_suite_end_to_end(tmp_path):
    """The whole ``bench suite --quick``: every scenario, every output file (minutes)."""
    out = tmp_path / "suite"
    assert cli_main(["bench", "suite", "--quick", "--out", str(out)]) == 0
    written = json.loads((out / "results.json").read_text())
    assert {"meta", "sizes", "limits", "training", "gpu_model", "deepspeed"} <= set(written)
    for name in ("throughput_by_size.png", "iteration_time.png", "frequency.png", "data_parallel.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert not (out / "work").exists()
