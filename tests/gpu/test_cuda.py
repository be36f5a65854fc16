"""Every CUDA-only line of the engine, on a real GPU (skipped elsewhere).

docs/ARCHITECTURE.md ("What no test here executes") lists them: ``CudaCopier`` (event after the
compute stream, private copy stream, ``.contiguous()`` temporaries kept until synchronised, the
stream synchronised for an abandoned copy), the pinned host cache, pinned restore buffers and
``non_blocking`` host-to-GPU copies in ``fast_read``, ``staged_read.read_into`` of GPU tensors through pinned
slots, ``restore._wants_cuda``, the NCCL branch of ``CommittedCheckpoint.agree_level``, and (two GPUs)
the engine's threads bound to the rank's device rather than GPU 0 (``device.py``). The scenarios
are shared with the CPU suite (``helpers.device_scenarios``). Issue 40's cases (portable pinning
and a checked unregister on the cache's device, restore readers ordered after the caller's side
stream, strided temporaries one run at a time, a file on two GPUs, ``to_device`` to another GPU,
one NCCL rank) have CPU twins in ``tests/engine/test_cuda_logic.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import host_cache
from megatron_ext.engine.read import fast_read, read_plan, staged_read
from megatron_ext.engine.read import file_reader as restore
from megatron_ext.engine.save.flow.copier import CudaCopier, CudaMark
from megatron_ext.procs import torchrun_command

from helpers import device_scenarios

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scenario", device_scenarios.SCENARIOS, ids=lambda s: s.__name__)
def test_scenario_on_cuda(scenario, tmp_path):
    scenario(tmp_path, "cuda")


def test_engine_uses_the_cuda_copier_and_a_pinned_cache(tmp_path):
    with device_scenarios.engine(tmp_path, host_cache_size=0.01) as engine:
        assert isinstance(engine.scheduler.copier, CudaCopier)
        engine.cache.wait_allocated(120)
        assert engine.cache.pinned and engine.cache.view(0).is_pinned()
        x = torch.arange(1000.0, device="cuda")
        mark = engine.scheduler.copier.mark([x])
        assert isinstance(mark, CudaMark) and isinstance(mark.marks[0].event, torch.cuda.Event)
        assert mark.device == x.device.index == engine.device == torch.cuda.current_device()
        assert engine.scheduler.copier.mark([torch.zeros(3)]) is None  # host tensors need no event


def test_restore_buffers_are_pinned_for_the_gpu():
    assert restore._wants_cuda("cuda") and restore._wants_cuda({"cpu": "cuda:0"})
    assert not restore._wants_cuda("cpu") and not restore._wants_cuda(None)
    buf = read_plan.aligned_buffer(3 * 4096 + 5, pin=True)
    assert buf.is_pinned() and buf.data_ptr() % 4096 == 0
    host = {"a": read_plan.aligned_buffer(4096, pin=True).fill_(7)}
    moved = fast_read.to_device(host, "cuda")
    assert moved["a"].is_cuda and torch.equal(moved["a"].cpu(), host["a"])


def test_read_into_cuda_tensors_streams_through_pinned_slots(tmp_path, monkeypatch):
    """GPU targets never get a host buffer the size of the file: pieces go through reused pinned slots."""
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(3 * read_plan.READ_PIECE // 4 + 999, generator=g), "b": torch.randn(77, generator=g)}
    with device_scenarios.engine(tmp_path, host_cache_size=0.01, restore_threads=3) as e:
        e.save_and_commit(state, "A", version=1)
        e.wait_persisted()
        reader = e.open_checkpoint("A").reader("rank00000")

        def no_file_sized_buffer(*args, **kwargs):
            raise AssertionError("a CUDA target was read through a fresh host buffer")

        monkeypatch.setattr(staged_read, "read_tensors", no_file_sized_buffer)
        targets = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
        reader.read_into(targets)
        staging = staged_read.default_staging(3)
        staging.wait_allocated(60)
        assert staging.pinned and staging.free_slots == staging.num_slots
        for name, want in state.items():
            device_scenarios.assert_bits(targets[name], want, name)


def test_bench_engine_on_cuda_prints_the_cpu_keys(tmp_path):
    from megatron_ext.bench import engine_bench

    cpu = engine_bench.run(0.01, str(tmp_path / "cpu"), compute_s=0.05, device="cpu")
    proc = subprocess.run([sys.executable, "-m", "megatron_ext", "bench", "engine", "--device", "cuda", "--size-gb",
                           "0.01", "--compute-s", "0.05", "--json", "--dir", str(tmp_path / "cuda")],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    gpu = json.loads(proc.stdout)
    assert set(gpu) == set(cpu) and gpu["device"] == "cuda" and gpu["d2h_gbps"] > 0


def test_one_nccl_rank_runs_the_engines_collectives_on_the_gpu(tmp_path):
    """One GPU, one NCCL rank: ``all_reduce_int`` and ``CommittedCheckpoint.agree_level`` on the default group take
    the device rule's CUDA tensor, and NCCL refuses a host tensor (what the rule is for)."""
    out = tmp_path / "out"
    out.mkdir()
    worker = REPO / "tests" / "engine" / "_restore_worker.py"
    cmd = torchrun_command(1, str(worker), str(tmp_path / "root"), str(out), "-1", "nccl")
    proc = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads((out / "rank-0.json").read_text())
    assert result["backend"] == "nccl" and result["level"] == "local" and result["exact"], result
    assert result["all_reduce_int"] == 1 and result["collective_device"] == "cuda:0", result
    assert result["refuses_host"] is True, result


def test_host_cache_pins_portable_and_unpins_from_any_thread():
    """Closed from a thread that never touched CUDA: unregistered on the cache's device, result checked."""
    cache = host_cache.HostCache(8 << 20, 1 << 20, pin=True, device=torch.cuda.current_device())
    cache.wait_allocated(60)
    assert cache.view(0).is_pinned()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            cache.close()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=close)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors


def test_restore_readers_wait_for_the_callers_side_stream(tmp_path):
    """The caller's side stream still has a NaN fill of the targets queued (behind a GPU sleep) when
    it asks for the restore: the readers' copies land after it."""
    state = {"w": torch.randn(3 * read_plan.READ_PIECE // 4 + 999), "b": torch.randn(77)}
    with device_scenarios.engine(tmp_path, host_cache_size=0.01) as e:
        e.save_and_commit(state, "A", version=1)
        e.wait_persisted()
        reader = e.open_checkpoint("A").reader("rank00000")
    targets = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
    staging = staged_read.HostCache(4 * read_plan.READ_PIECE, read_plan.READ_PIECE, pin=True,
                                    device=torch.cuda.current_device())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            device_scenarios.late_fill(targets["w"], float("nan"))
            targets["b"].fill_(float("nan"))
            staged_read.stream_into(reader.tensor_path, reader.listed, targets, staging, threads=3)
        torch.cuda.synchronize()
    finally:
        staging.close()
    for name, want in state.items():
        device_scenarios.assert_bits(targets[name], want, name)


def test_strided_temporaries_stay_within_a_run(tmp_path):
    """16 strided 8 MB tensors through a 16 MB cache: the GPU never holds all their temporaries (128 MB)."""
    base = torch.randn(16, 1024, 2048, device="cuda")
    state = {f"t{i}": base[i].t() for i in range(16)}
    with device_scenarios.engine(tmp_path, host_cache_size=0.016, chunk_size_mb=1) as e:
        e.cache.wait_allocated(60)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        e.save(state, "A", version=1)
        e.wait_snapshot()
        peak = torch.cuda.max_memory_allocated() - before
        e.commit("A")
        e.wait_persisted()
        loaded = e.load("A")
    assert peak <= 4 * (8 << 20), f"{peak / 2**20:.0f} MiB of temporaries at once"
    for name in ("t0", "t7", "t15"):
        device_scenarios.assert_bits(loaded[name], state[name].contiguous(), name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a file on two GPUs needs two GPUs")
def test_a_file_on_two_gpus_is_ordered_and_complete_on_both(tmp_path):
    a = torch.zeros(4 << 20, device="cuda:0")
    b = torch.zeros(4 << 20, device="cuda:1")
    with device_scenarios.engine(tmp_path, host_cache_size=0.05) as e:
        device_scenarios.late_fill(a, 1.0)
        with torch.cuda.device(1):
            device_scenarios.late_fill(b, 2.0)
        e.save({"a": a, "b": b}, "A", version=1)
        e.wait_snapshot()
        a.fill_(-1.0)
        b.fill_(-1.0)
        e.commit("A")
        e.wait_persisted()
        loaded = e.load("A")
    device_scenarios.assert_bits(loaded["a"], torch.ones(4 << 20), "a (GPU 0)")
    device_scenarios.assert_bits(loaded["b"], torch.full((4 << 20,), 2.0), "b (GPU 1)")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="another GPU needs two")
def test_restore_to_another_gpu_is_synchronised_and_pinned_there():
    staging = staged_read.default_staging(2)
    staging.wait_allocated(60)
    with torch.cuda.device(1):
        assert staging.view(0).is_pinned()  # portable: pinned in GPU 1's context too
    host = {"a": read_plan.aligned_buffer(64 << 20, pin=True).fill_(7)}
    moved = fast_read.to_device(host, "cuda:1")  # the current device stays GPU 0
    assert moved["a"].device == torch.device("cuda", 1)
    assert torch.equal(moved["a"].cpu(), host["a"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL branch needs two GPUs")
@pytest.mark.parametrize("drop_rank, level", [(-1, "local"), (1, "shared")])
def test_all_ranks_agree_on_one_level_over_nccl(tmp_path, drop_rank, level):
    out = tmp_path / "out"
    out.mkdir()
    worker = REPO / "tests" / "engine" / "_restore_worker.py"
    cmd = torchrun_command(2, str(worker), str(tmp_path / "root"), str(out), str(drop_rank), "nccl")
    proc = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for r in range(2):
        result = json.loads((out / f"rank-{r}.json").read_text())
        assert result["backend"] == "nccl"
        assert result["level"] == level and result["levels_used"] == [level] and result["exact"], result


def test_graph_safe_cuda_generators_round_trip_through_a_checkpoint(tmp_path):
    """CUDA graphs / --te-rng-tracker: the tracker holds CUDA generators (issue 26); saved as states, set back in place."""
    pytest.importorskip("megatron.core")
    from megatron.core import tensor_parallel

    from megatron_ext.megatron import checkpoint_layout as listed

    from helpers.states import through_a_checkpoint

    tracker = tensor_parallel.get_cuda_rng_tracker()
    kept = tracker.get_states()
    generators = {"model-parallel-rng": torch.cuda.default_generators[0].clone_state()}
    generators["model-parallel-rng"].manual_seed(11)
    tracker.set_states(dict(generators))
    try:
        captured = listed.capture_rng_state()
        expected = torch.rand(8, device="cuda", generator=generators["model-parallel-rng"])
        loaded = through_a_checkpoint(tmp_path, {"rng": captured})["rng"]
        listed.restore_rng_state(loaded)
        assert tracker.get_states()["model-parallel-rng"] is generators["model-parallel-rng"]
        assert torch.equal(torch.rand(8, device="cuda", generator=generators["model-parallel-rng"]), expected)
    finally:
        tracker.set_states(kept)


def _devices_seen(engine, seen: dict) -> None:
    """Record ``torch.cuda.current_device()`` on the copy thread (each run's copies) and the writer
    thread (each wait for a run's copies)."""
    copier = engine.scheduler.copier
    inner_copy, inner_ready = copier.copy_many, copier.chunk_ready

    def copy(*args):
        seen.setdefault("copy", set()).add(torch.cuda.current_device())
        return inner_copy(*args)

    def chunk_ready():
        ready = inner_ready()

        def wait():
            seen.setdefault("writer", set()).add(torch.cuda.current_device())
            ready()

        return wait

    copier.copy_many, copier.chunk_ready = copy, chunk_ready


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a device other than GPU 0 needs two GPUs")
def test_engine_threads_work_on_the_ranks_device_not_gpu_0(tmp_path):
    """A rank on GPU 1: the copy thread works on the saved tensors' device, the writer thread on the
    rank's, and the pinned cache is registered there; none of them on GPU 0 (device.py)."""
    torch.cuda.set_device(1)
    try:
        seen: dict = {}
        with device_scenarios.engine(tmp_path / "a", host_cache_size=0.01) as engine:
            assert engine.device == 1 and engine.scheduler.copier.device == 1
            _devices_seen(engine, seen)
            x = torch.arange(1 << 20, dtype=torch.float32, device="cuda:1")
            engine.save_and_commit({"x": x}, "A", version=1)
            engine.wait_snapshot()
            engine.wait_persisted()
            device_scenarios.assert_bits(engine.load("A")["x"], x.cpu(), "x")
        assert seen == {"copy": {1}, "writer": {1}}
        # Host tensors only: the copy thread binds to the rank's device (the one current at construction).
        seen.clear()
        with device_scenarios.engine(tmp_path / "b", host_cache_size=0.01) as engine:
            _devices_seen(engine, seen)
            engine.save_and_commit({"y": torch.arange(1000.0)}, "B", version=1)
            engine.wait_persisted()
        assert seen == {"copy": {1}, "writer": {1}}
    finally:
        torch.cuda.set_device(0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a device other than GPU 0 needs two GPUs")
def test_restore_readers_copy_on_the_targets_device(tmp_path):
    seen = set()

    class Recording(staged_read.HostCache):
        def view(self, slot):  # called by the reader right before its copy to the targets
            seen.add(torch.cuda.current_device())
            return super().view(slot)

    state = {"w": torch.randn(3 * read_plan.READ_PIECE // 4 + 999)}
    with device_scenarios.engine(tmp_path, host_cache_size=0.01) as e:
        e.save_and_commit(state, "A", version=1)
        e.wait_persisted()
        reader = e.open_checkpoint("A").reader("rank00000")
        targets = {"w": torch.zeros_like(state["w"], device="cuda:1")}
        staging = Recording(4 * read_plan.READ_PIECE, read_plan.READ_PIECE, pin=True, device=1)
        staged_read.stream_into(reader.tensor_path, reader.listed, targets, staging, threads=3)
        staging.close()
    assert seen == {1}
    device_scenarios.assert_bits(targets["w"], state["w"], "w")
