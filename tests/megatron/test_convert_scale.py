"""``megatron-ext convert --to datastates`` at the 180-GPU template's layout (configs/gpt_70b_180gpu.env:
TP=4 x PP=5 x DP=9), with bounded memory, processes and shared memory.

The source is a real megatron-core ``torch_dist`` checkpoint of that layout: every shard its 180
ranks would write (a 10-layer GPT with Adam moments, 84 MB of tensors), written by megatron-core's
own ``dist_checkpointing.save`` from one process (``megatron_ext.testing.torch_dist_layout``).

The conversion runs as the CLI does, in a child process under watch (``helpers.process_watch``):

* its peak RSS (``ru_maxrss``) stays within a bound derived from the checkpoint, not from the
  number of ranks: the same command's RSS once its modules are imported (measured: the command
  run on a missing source) + 1.5 x the tensor bytes (the source loaded once) + two write buffers
  + 64 MiB;
* its process tree never holds more than 4 processes (the command and short-lived helpers the
  imports may start) and at most one shared-memory segment.

The result passes ``verify``; converted back to ``torch_dist`` it holds exactly the source's tensors
(megatron-core's ``load_plain_tensors`` on both), so a load gives bit-identical state.

Before the single writer, convert built one engine per rank: at this layout 180 host caches of
0.25 GiB (45 GiB of shared memory) and 180 I/O worker processes in one process; under this watch it
is killed at its second shared-memory segment.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from helpers.process_watch import run_watched  # noqa: E402
from helpers.procs import REPO, child_env  # noqa: E402
from helpers.torch_dist_compare import SAME_TENSORS  # noqa: E402

TP, PP, DP = 4, 5, 9  # configs/gpt_70b_180gpu.env
TIMEOUT_S = 600
CHUNK_BYTES = 16 << 20  # the writer's buffer (convert's default chunk)
MAX_PROCESSES = 4
MAX_MEMFDS = 1


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=child_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return proc


def _convert_watched(source: str, out: str):
    return run_watched([sys.executable, "-m", "megatron_ext", "convert", source, "--to", "datastates", out, "--json"],
                       env=child_env(CUDA_VISIBLE_DEVICES=""), cwd=str(REPO), timeout_s=TIMEOUT_S,
                       max_processes=MAX_PROCESSES, max_memfds=MAX_MEMFDS)


def test_convert_at_the_180_rank_layout_has_bounded_memory_and_processes(tmp_path):
    source = tmp_path / "torch_dist"
    built = json.loads(_run("-m", "megatron_ext.testing.torch_dist_layout", str(source), "--tp", str(TP),
                            "--pp", str(PP), "--dp", str(DP)).stdout.strip().splitlines()[-1])
    assert built["ranks"] == 180
    tensor_bytes = built["tensor_bytes"]

    imports_only = _convert_watched(str(tmp_path / "missing"), str(tmp_path / "unused"))
    assert imports_only.returncode != 0 and "is not a directory" in imports_only.stderr, imports_only.stderr[-2000:]
    bound = imports_only.max_rss_bytes + int(1.5 * tensor_bytes) + 2 * CHUNK_BYTES + (64 << 20)

    out = tmp_path / "datastates"
    run = _convert_watched(str(source), str(out))
    figures = (f"peak RSS {run.max_rss_bytes / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB, imports alone "
               f"{imports_only.max_rss_bytes / 2**20:.0f} MiB, tensors {tensor_bytes / 2**20:.0f} MiB), "
               f"{run.peak_processes} process(es), {run.peak_memfds} shared-memory segment(s), {run.wall_s:.0f}s")
    print(figures)
    assert run.killed_for is None, f"convert was stopped: {run.killed_for}; {figures}"
    assert run.returncode == 0, run.stderr[-6000:]
    summary = json.loads(run.stdout)
    assert summary["ranks"] == 180 and summary["layout"] == {"tp": TP, "pp": PP, "dp": DP}
    assert summary["shards"] == built["shards"]
    assert run.max_rss_bytes <= bound, figures
    assert run.peak_processes <= MAX_PROCESSES and run.peak_memfds <= MAX_MEMFDS, figures

    _run("-m", "megatron_ext", "verify", str(out))
    rows = json.loads(_run("-m", "megatron_ext", "inspect", str(out), "--json").stdout)
    assert [(r["checkpoint"], r["committed"], r["ranks"]) for r in rows] == [("iter_0000007", True, 180)]

    back = tmp_path / "back"
    _run("-m", "megatron_ext", "convert", str(out), "--to", "torch_dist", str(back))
    _run("-c", SAME_TENSORS, str(source / "iter_0000007"), str(back / "iter_0000007"), "189")
