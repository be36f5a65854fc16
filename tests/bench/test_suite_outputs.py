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

    assert files == ["results.json", "results.md", "blocked_by_size.png", "durable_by_size.png"]
    for name in files[2:]:
        assert (out / name).read_bytes()[:8] == PNG
    written = json.loads((out / "results.json").read_text())
    assert set(written) == {"meta", "sizes", "limits", "gpu_model"}
    assert [r["approach"] for r in written["sizes"]] == list(suite.SIZE_APPROACHES)
    for r in written["sizes"]:
        assert r["size_mb"] == 4 and r["size_bytes"] >= 4 << 20
        assert 0 < r["blocked_s"] <= r["done_s"]
        # A rate only where bytes moved: size / seconds until durable; never size / seconds blocked.
        assert r["durable_gbps"] == pytest.approx(r["size_bytes"] / r["done_s"] / 1e9)
        assert "throughput_gbps" not in r
    assert written["limits"]["memcpy_gbps"] > 0 and written["limits"]["direct_write_gbps"] > 0
    assert set(written["gpu_model"]["predictions"]) == {f"engine/{g}gpu/every{k}" for g in (180, 80) for k in (1, 10)}

    table = (out / "results.md").read_text()
    assert "| approach | 4 MB |" in table
    blocked, durable = table.split("## Seconds training is blocked")[1].split("## Seconds from the save")
    for r in sizes:
        assert f"| {r['approach']} | {r['blocked_s']:.4f} |" in blocked
        assert f"| {r['approach']} | {r['done_s']:.3f} ({r['durable_gbps']:.2f} GB/s) |" in durable
    # Each limit beside the figures it bounds, in seconds for the same bytes.
    memcpy_s = sizes[0]["size_bytes"] / (limits["memcpy_gbps"] * 1e9)
    write_s = sizes[0]["size_bytes"] / (limits["direct_write_gbps"] * 1e9)
    assert f"| *{suite.MEMCPY_LIMIT}* | {memcpy_s:.4f} |" in blocked
    assert f"| *{suite.WRITE_LIMIT}* | {write_s:.3f} |" in durable
    assert "size / time blocked" not in table
    # The GPU model leads with seconds; no "throughput" of size over a stall.
    assert "| engine | 180 | 1 |" in table and "throughput GB/s" not in table
    assert "DataStates 1.67 s" in table


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
    assert p.durable_s == pytest.approx(p.bookkeeping_s + max(p.d2h_s, p.flush_s))  # copy and flush overlap
    assert not hasattr(p, "throughput_gbps")
    slow = gpu_model.predict(a, b, flush_efficiency=0.05, gpus=180, interval=1)
    assert slow.flush_stall_s == pytest.approx(slow.flush_s - 23.65)  # the flush no longer keeps up
    with pytest.raises(ValueError, match="do not fill nodes"):
        gpu_model.predict(a, b, 1.0, gpus=181)


@pytest.mark.slow
def test_quick_suite_end_to_end(tmp_path, capsys):
    """The whole ``bench suite --quick --json``: every scenario, every output file, the printed object
    the results file's (minutes)."""
    out = tmp_path / "suite"
    assert cli_main(["bench", "suite", "--quick", "--out", str(out), "--json"]) == 0
    written = json.loads((out / "results.json").read_text())
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(written, default=str))  # progress: stderr
    assert {"meta", "sizes", "limits", "training", "gpu_model", "deepspeed"} <= set(written)
    for name in ("blocked_by_size.png", "durable_by_size.png", "iteration_time.png", "frequency.png",
                 "data_parallel.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert not (out / "work").exists()
