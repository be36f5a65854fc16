"""Runs of neighbouring cache slots: the snapshot copies, checksums and writes many chunks per call.

Each call that releases the GIL costs a Python-bound training thread a round trip when the engine's
thread takes the GIL back (docs/ARCHITECTURE.md, "The GIL"), so the save path works on runs of
slots rather than on single chunks. These tests check the allocator, that a file needs few copy
and write calls, and that what lands on disk is bit-exact whatever the runs look like.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.engine import faults
from megatron_ext.engine.errors import CacheError
from megatron_ext.engine.host_cache import HostCache
from megatron_ext.engine.save.flow import copier
from megatron_ext.engine.save.flow.snapshot import run_slots

from helpers.states import assert_same, clone_state

CHUNK = 4096


def _cache(slots: int) -> HostCache:
    cache = HostCache(slots * CHUNK, CHUNK, pin=False)
    cache.wait_allocated(60)
    return cache


def test_acquire_run_takes_the_longest_run_of_neighbouring_free_slots():
    cache = _cache(8)
    try:
        assert cache.acquire_run(8, 5) == (0, 8)
        for slot in (1, 2, 5, 6, 7):
            cache.release(slot)
        assert cache.acquire_run(8, 5) == (5, 3)  # the longest run, not the first slot
        assert cache.acquire_run(1, 5) == (1, 1)  # capped at ``most``
        assert cache.acquire_run(4, 5) == (2, 1)
        assert cache.free_slots == 0
        cache.release_run(3, 4)
        assert cache.free_slots == 4 and cache.acquire_run(8, 5) == (3, 4)
        with pytest.raises(CacheError, match="no host cache slot was freed"):
            cache.acquire_run(1, 0.05)
    finally:
        cache.close()


def test_acquire_run_waits_for_a_slot_and_reports_the_wait():
    cache = _cache(2)
    try:
        assert cache.acquire_run(2, 5) == (0, 2)
        waited = threading.Event()
        threading.Timer(0.1, cache.release_run, args=(0, 2)).start()
        assert cache.acquire_run(2, 10, on_wait=waited.set) == (0, 2)
        assert waited.is_set()
    finally:
        cache.close()


def test_run_memory_spans_neighbouring_slots():
    cache = _cache(4)
    try:
        first, count = cache.acquire_run(4, 5)
        view = cache.run_view(first, count)
        view.copy_(torch.arange(count * CHUNK, dtype=torch.int64).remainder(251).to(torch.uint8))
        assert bytes(cache.memory(first, count * CHUNK)) == view.numpy().tobytes()
    finally:
        cache.close()


def test_run_slots_is_half_the_cache_at_most_max_run_bytes_and_at_least_one():
    from megatron_ext.engine.save.flow.snapshot import MAX_RUN_BYTES

    assert run_slots(_cache(1)) == 1
    assert run_slots(_cache(16)) == 8
    big = SimpleNamespace(num_slots=1024, chunk_bytes=16 << 20)  # a 16 GiB cache of 16 MiB slots
    assert run_slots(big) == MAX_RUN_BYTES // (16 << 20) < 512


def test_a_file_is_copied_and_written_in_few_calls(make_engine, fault, monkeypatch):
    # 12 tensors of 16 KiB (4 chunks each) through a cache that holds the whole file: one run (two at
    # most), so one batched copy and one write per run, not one per chunk (49) or per tensor (12).
    state = {f"t{i}": torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(12)}
    expected = clone_state(state)
    calls = []
    real = copier.CpuCopier.copy_many
    monkeypatch.setattr(copier.CpuCopier, "copy_many",
                        lambda self, parts: (calls.append(len(parts)), real(self, parts)))
    writes = []
    fault(lambda level, path, offset, nbytes:
          writes.append((offset, nbytes)) if path.endswith(".safetensors") else None)
    engine = make_engine(host_cache_size=0.001, chunk_size_mb=CHUNK / 2**20)  # 256 slots: one run of 128 is enough
    engine.save(state, "A", version=1)
    engine.commit("A")
    engine.wait_persisted()
    assert len(calls) <= 2 and sum(calls) == 12 + (len(calls) - 1), calls  # a tensor split by a run counts twice
    assert len(writes) == len(calls), writes
    assert_same(engine.load("A"), expected)


@pytest.mark.parametrize("cache_kib", [16, 20, 64])
def test_runs_through_a_small_fragmented_cache_are_bit_exact(make_engine, cache_kib):
    # Strided and contiguous tensors of several dtypes, larger than the cache: runs of every length.
    g = torch.Generator().manual_seed(cache_kib)
    state = {"w": torch.randn(9000, generator=g), "t": torch.randn(70, 50, generator=g).t(),
             "h": torch.randn(33, 17, generator=g).to(torch.bfloat16), "i": torch.randint(0, 9, (1234,), generator=g),
             "e": torch.empty(0), "step": 3}
    expected = clone_state(state)
    engine = make_engine(host_cache_size=cache_kib / 2**20, chunk_size_mb=CHUNK / 2**20)
    engine.save(state, "A", version=3)
    engine.commit("A")
    engine.wait_persisted()
    assert_same(engine.load("A"), expected)
    faults.disarm_all()
