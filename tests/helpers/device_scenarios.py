"""The engine's device-dependent behaviour as scenarios that run on any device.

``tests/gpu`` runs them on ``cuda`` (a GPU node: ``CudaCopier``, the pinned host cache, pinned
restore buffers); ``tests/engine/test_device_scenarios.py`` runs the same code on ``cpu`` in the
default suite, so the scenarios themselves stay checked on machines without a GPU. Each takes a
fresh directory and the device, builds its own engines and shuts them down.

``late_fill(x, value)`` writes ``x`` with a kernel queued behind about 50 ms of GPU sleep: when
``save`` returns, the kernel has not run yet, so a copy not ordered after it would read the old
values. On a CPU the write is synchronous.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from megatron_ext.engine import CheckpointEngine, faults

#: ~105 KB host cache of 4 KiB chunks: chunk boundaries fall inside tensors, tensors outgrow the cache.
TINY = {"host_cache_size": 0.0001, "chunk_size_mb": 0.004}
FAST = {"snapshot_timeout_s": 60.0, "persist_timeout_s": 60.0}
SLEEP_CYCLES = 100_000_000  # ~50 ms on a 1.4-2 GHz GPU clock


def engine(directory: Path, **config: Any) -> CheckpointEngine:
    return CheckpointEngine({"save_dir": str(directory / "ckpt"), **FAST, **config}, rank=0, world_size=1)


def late_fill(x: torch.Tensor, value: float) -> None:
    """``x.fill_(value)`` queued behind a GPU sleep on the current stream (synchronous on CPU)."""
    if x.is_cuda:
        torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(value)


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bytes (compared on the host; NaN-safe)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    a = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(a, b), f"{what}: bytes differ"


def copy_is_ordered_after_the_kernel_that_wrote_the_tensor(directory: Path, device: str) -> None:
    """The snapshot holds what a kernel still queued at ``save`` time wrote (CUDA: event on the compute stream)."""
    with engine(directory, host_cache_size=0.05) as e:
        x = torch.zeros(4 << 20, device=device)  # 16 MB: several chunks
        late_fill(x, 1.0)
        e.save({"x": x}, "A", version=1)
        e.wait_snapshot()
        e.commit("A")
        e.wait_persisted()
        assert_bits(e.load("A")["x"], torch.ones(4 << 20), "snapshot of a tensor written by a queued kernel")


def mutation_right_after_wait_snapshot_stays_out(directory: Path, device: str) -> None:
    """A kernel that changes the tensor right after ``wait_snapshot`` does not reach the checkpoint."""
    with engine(directory, host_cache_size=0.05) as e:
        x = torch.zeros(4 << 20, device=device)
        late_fill(x, 1.0)  # the copy stream must wait for this one...
        e.save({"x": x}, "A", version=1)
        e.wait_snapshot()
        x.fill_(2.0)  # ...and must be done before this one may run
        e.commit("A")
        e.wait_persisted()
        assert_bits(e.load("A")["x"], torch.ones(4 << 20), "snapshot after a mutation following wait_snapshot")
        assert_bits(x, torch.full((4 << 20,), 2.0, device=device), "the live tensor")


def gated_copy_is_ordered_after_the_kernel_queued_before_open(directory: Path, device: str) -> None:
    """A save's ``CopyGate`` opened after a queued kernel (an all-gather) fills the tensor: the copy
    holds the filled values (CUDA: the mark is taken at ``open()``, not at ``save``)."""
    from megatron_ext.engine import CopyGate

    with engine(directory, host_cache_size=0.05) as e:
        x = torch.zeros(4 << 20, device=device)
        gate = CopyGate(settle=lambda: None)
        e.save({"x": x}, "A", version=1, gate=gate)
        late_fill(x[1 << 20:], 3.0)  # queued after the save returned, before the gate opens
        gate.open()
        e.wait_snapshot()
        x.fill_(4.0)  # the next optimizer step
        e.commit("A")
        e.wait_persisted()
        want = torch.zeros(4 << 20)
        want[1 << 20:] = 3.0
        assert_bits(e.load("A")["x"], want, "a gated snapshot of a tensor filled in after the save")


def non_contiguous_tensors_round_trip(directory: Path, device: str) -> None:
    """Strided views of every common kind, through a tiny cache, the caller dropping its references early."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(301, 257, generator=g).to(device)
    state = {
        "transposed": base.t(),
        "every_other_row": base[::2],
        "column_block": base[:, 100:200],
        "permuted": torch.randn(9, 17, 33, generator=g).to(device).permute(2, 0, 1),
        "bf16_strided": base.to(torch.bfloat16)[1::3, ::2],
        "expanded": torch.arange(7.0).to(device).expand(50, 7),
        "contiguous": torch.arange(10_000, dtype=torch.int64).to(device),
    }
    assert not all(t.is_contiguous() for t in state.values())
    expected = {k: v.detach().cpu().clone() for k, v in state.items()}
    with engine(directory, **TINY) as e:
        e.save(state, "A", version=1)
        del state, base  # the engine keeps what it needs until the copies are done
        churn = [torch.full((1 << 20,), float(i), device=device) for i in range(8)]  # reuse of freed memory
        e.wait_snapshot()
        del churn
        e.commit("A")
        e.wait_persisted()
        loaded = e.load("A")
    for name, want in expected.items():
        assert_bits(loaded[name], want.contiguous(), name)


def abandoned_copy_lets_training_go_on(directory: Path, device: str) -> None:
    """``supersede`` with the writer stuck: ``wait_snapshot`` abandons the starving copy and returns; the
    tensor may then change; the next checkpoint is complete and the abandoned one never commits."""
    gate = threading.Event()
    faults.arm(lambda level, path, offset, nbytes: gate.wait(60) if path.endswith(".safetensors") else None)
    try:
        with engine(directory, **TINY, overload_policy="supersede") as e:
            big = torch.arange(60_000, dtype=torch.float32, device=device)  # 240 KB through a ~100 KB cache
            e.save({"w": big}, "A", version=1)
            e.commit("A")
            deadline = time.monotonic() + 60
            while e.scheduler.starved is None:  # the copy now waits for a slot the stuck writer holds
                assert time.monotonic() < deadline, "the copy never started waiting for cache space"
                time.sleep(0.01)
            e.wait_snapshot()  # abandons A instead of waiting for the flush
            big.fill_(-1.0)  # training goes on; A's copy must not read this any more
            gate.set()
            while e.cache.free_slots < e.cache.num_slots:  # A's chunks drain; else B would starve too
                assert time.monotonic() < deadline, "the abandoned checkpoint's slots were never freed"
                time.sleep(0.01)
            small = torch.full((100,), 3.0, device=device)
            e.save({"w": small}, "B", version=2)
            e.wait_snapshot()
            e.commit("B")
            e.wait_persisted()
            skipped = [(r["checkpoint"], r["reason"]) for r in e.telemetry.records if r["event"] == "skipped"]
            assert skipped == [("A", "no_cache_space")], skipped
            assert e.latest() == "B"
            assert_bits(e.load("B")["w"], torch.full((100,), 3.0), "checkpoint after an abandoned one")
    finally:
        gate.set()
        faults.disarm_all()


def restore_into_device_tensors(directory: Path, device: str) -> None:
    """``load(map_location=device)`` and ``load_into`` a template living on the device, bit-exact."""
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1000, 300, generator=g), "h": torch.randn(4097, generator=g).to(torch.bfloat16),
             "ids": torch.arange(12345, dtype=torch.int64), "scalar": torch.tensor(2.5, dtype=torch.float64),
             "step": 7}
    with engine(directory, host_cache_size=0.02, restore_threads=3) as e:
        e.save_and_commit(state, "A", version=1)
        e.wait_persisted()
        loaded = e.load("A", map_location=device)
        assert loaded["step"] == 7
        for name in ("w", "h", "ids", "scalar"):
            assert loaded[name].device.type == torch.device(device).type, name
            assert_bits(loaded[name], state[name], f"load(map_location={device!r}) {name}")
        template = {k: torch.zeros_like(v, device=device) if isinstance(v, torch.Tensor) else v
                    for k, v in state.items()}
        template["w"] = torch.zeros(300, 1000, device=device).t()  # a strided target too
        pointers = {k: v.data_ptr() for k, v in template.items() if isinstance(v, torch.Tensor)}
        into = e.load_into("A", template)
        for name in ("w", "h", "ids", "scalar"):
            assert into[name].data_ptr() == pointers[name], f"{name} was not filled in place"
            assert_bits(into[name], state[name], f"load_into {name}")


SCENARIOS = [copy_is_ordered_after_the_kernel_that_wrote_the_tensor, mutation_right_after_wait_snapshot_stays_out,
             gated_copy_is_ordered_after_the_kernel_queued_before_open, non_contiguous_tensors_round_trip, abandoned_copy_lets_training_go_on, restore_into_device_tensors]
