"""Which CUDA device the engine's threads bind to (``megatron_ext/engine/device.py``), checked without a GPU.

The choice is plain Python, and the binding goes through ``torch.cuda.set_device``, recorded here
per thread: every engine thread that touches CUDA binds to the rank's device before anything
else, never leaving GPU 0 current. ``tests/gpu`` checks the same on two real GPUs.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from helpers.device_scenarios import engine as make_engine
from megatron_ext.engine import device, engine as engine_module
from megatron_ext.engine.host_cache import HostCache


def _on(where: str):
    return types.SimpleNamespace(device=torch.device(where))


def test_the_tensors_device_comes_first_then_the_ranks():
    assert device.cuda_device_of([torch.zeros(1), _on("cuda:3"), _on("cuda:1")]) == 3
    assert device.cuda_device_of([_on("cuda")]) == 0  # a device without an index is the first one
    assert device.cuda_device_of([torch.zeros(1), _on("meta")]) is None
    assert device.cuda_device_of([]) is None
    assert device.thread_device(3, 1) == 3
    assert device.thread_device(None, 1) == 1
    assert device.thread_device(None, None) is None


def test_binding_sets_the_device_only_with_one():
    calls = []
    device.bind_thread(None, calls.append)
    assert calls == []
    device.bind_thread(2, calls.append)
    assert calls == [2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_there_is_no_rank_device():
    assert device.rank_device() is None


@pytest.fixture
def set_device_calls(monkeypatch):
    """``torch.cuda.set_device`` recorded as (thread name, device), instead of called."""
    calls: list[tuple[str, int]] = []
    lock = threading.Lock()

    def record(index: int) -> None:
        with lock:
            calls.append((threading.current_thread().name, index))

    monkeypatch.setattr(torch.cuda, "set_device", record)
    return calls


def test_the_host_cache_binds_its_allocating_thread(set_device_calls):
    cache = HostCache(4 * 4096, 4096, pin=False, device=5)
    cache.wait_allocated(30)
    cache.close()
    assert set_device_calls == [("datastates-cache-alloc", 5)]


@pytest.mark.parametrize("flush_process", [True, False])
def test_every_engine_thread_that_touches_cuda_binds_to_the_rank_device(tmp_path, monkeypatch, set_device_calls,
                                                                        flush_process):
    """The device current on the constructing thread (here 3) is where the copy, write (it waits
    for the copies' events) and cache threads work; the training thread's own device is never changed."""
    monkeypatch.setattr(engine_module, "rank_device", lambda: 3)
    with make_engine(tmp_path, host_cache_size=0.001, flush_process=flush_process) as e:
        assert e.device == 3 and e.save_context.device == 3
        e.save_and_commit({"x": torch.arange(5000.0)}, "A", version=1)
        e.wait_snapshot()
        e.wait_persisted()
    threads = {name for name, _ in set_device_calls}
    assert {index for _, index in set_device_calls} == {3}
    assert {"datastates-cache-alloc", "datastates-snapshot"} <= threads
    assert any(name.startswith("datastates-writer-") for name in threads)
    assert threading.current_thread().name not in threads


def test_without_cuda_nothing_is_bound(tmp_path, set_device_calls):
    with make_engine(tmp_path, host_cache_size=0.001) as e:
        e.save_and_commit({"x": torch.arange(10.0)}, "A", version=1)
        e.wait_persisted()
        assert e.device == device.rank_device()
    if not torch.cuda.is_available():
        assert set_device_calls == []
