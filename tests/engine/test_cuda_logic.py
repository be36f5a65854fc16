"""The logic of the engine's CUDA-only lines, on the CPU: fake device ids, a recording ``cudart`` and
a stream stand-in whose queued work runs only when waited for (``helpers.fake_cuda``).

``tests/gpu/test_cuda.py`` runs the same cases on real GPUs; these keep their logic checked here.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref

import pytest
import torch

from helpers import device_scenarios
from helpers.fake_cuda import FakeCuda, FakeEvent, FakeMark, FakeStream
from megatron_ext.engine import host_cache
from megatron_ext.engine.errors import CacheError
from megatron_ext.engine.read import fast_read, read_plan, staged_read
from megatron_ext.engine.save import pipeline
from megatron_ext.engine.save.flow.copier import CpuCopier, CudaCopier, byte_source


class RecordingCudart:
    """``torch.cuda.cudart()``'s two calls the host cache makes, recorded with the device current then."""

    def __init__(self, current: threading.local, unregister_status: int = 0, hold: threading.Event | None = None):
        self.current, self.unregister_status, self.hold = current, unregister_status, hold
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, flags, getattr(self.current, "device", None)))
        if self.hold is not None:
            assert self.hold.wait(30), "the test never released the registration"
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, None, getattr(self.current, "device", None)))
        return self.unregister_status


@pytest.fixture
def cudart(monkeypatch):
    """A recording cudart; ``set_device`` and ``on_device`` keep a per-thread 'current device'."""
    current = threading.local()

    @contextlib.contextmanager
    def on_device(device):
        before = getattr(current, "device", None)
        current.device = device
        try:
            yield
        finally:
            current.device = before

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: setattr(current, "device", device))
    monkeypatch.setattr(host_cache, "on_device", on_device)

    def make(**kwargs) -> RecordingCudart:
        fake = RecordingCudart(current, **kwargs)
        monkeypatch.setattr(host_cache, "_cudart", lambda: fake)
        return fake

    return make


# ----------------------------------------------------------------------------- host_cache.py
def test_the_cache_is_pinned_portable_and_unpinned_on_its_own_device(cudart):
    """Registered for every GPU's context (staging slots feed targets on any GPU); unregistered
    bound to the cache's device, whichever thread closes it."""
    fake = cudart()
    cache = host_cache.HostCache(4 * 4096, 4096, pin=True, device=5)
    cache.wait_allocated(30)
    ptr = cache.view(0).data_ptr()
    cache.close()
    assert fake.calls == [("register", ptr, host_cache.REGISTER_PORTABLE, 5), ("unregister", ptr, None, 5)]
    assert host_cache.REGISTER_PORTABLE == 1  # cudaHostRegisterPortable


def test_default_staging_is_pinned_portable(cudart, monkeypatch):
    fake = cudart()
    monkeypatch.setattr(staged_read, "_default_staging", {})
    monkeypatch.setattr(staged_read.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staged_read, "rank_device", lambda: 0)
    staging = staged_read.default_staging(1)
    staging.wait_allocated(30)
    staging.close()
    assert [c[2] for c in fake.calls if c[0] == "register"] == [host_cache.REGISTER_PORTABLE]


def test_a_failed_unregister_raises_and_leaves_the_memory_mapped(cudart):
    cudart(unregister_status=700)
    cache = host_cache.HostCache(4 * 4096, 4096, pin=True, device=0)
    cache.wait_allocated(30)
    with pytest.raises(CacheError, match="cudaHostUnregister .* failed .*700"):
        cache.close()
    assert not cache._mmap.closed


def test_close_does_not_unmap_while_registration_still_runs(cudart):
    hold = threading.Event()
    fake = cudart(hold=hold)
    cache = host_cache.HostCache(4 * 4096, 4096, pin=True, device=0)
    try:
        with pytest.raises(CacheError, match="still running"):
            cache.close(timeout=0.2)
        assert not cache._mmap.closed and cache.shared_fd is not None
    finally:
        hold.set()
        cache._thread.join(30)
    assert [c[0] for c in fake.calls] == ["register"]


# ----------------------------------------------------------------------------- fast_read.py
def test_to_device_synchronises_the_stream_of_each_target_device(monkeypatch):
    """``map_location`` naming another GPU: its stream is synchronised, not the current device's."""
    synced = []
    monkeypatch.setattr(fast_read, "_synchronize", synced.append)
    on = {"a": torch.device("cuda", 1), "b": torch.device("cuda", 3), "c": torch.device("cpu")}

    def move(tensor, _where):
        return types.SimpleNamespace(device=on[names[id(tensor)]], is_cuda=on[names[id(tensor)]].type == "cuda")

    host = {k: torch.zeros(2) for k in on}
    names = {id(v): k for k, v in host.items()}
    moved = fast_read.to_device(host, move)
    assert sorted(synced) == [1, 3] and set(moved) == set(on)
    synced.clear()
    fast_read.to_device(host, "cpu")
    assert synced == []


# ----------------------------------------------------------------------------- staged_read.py
def test_restore_readers_wait_for_work_the_caller_queued_on_the_targets(tmp_path, monkeypatch):
    """The caller queued a write of NaN to the targets (a non-default stream); the readers' copies
    must come after it, else it lands on the restored values."""
    g = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(3 * read_plan.READ_PIECE // 4 + 999, generator=g), "b": torch.randn(77, generator=g)}
    with device_scenarios.engine(tmp_path, host_cache_size=0.01) as e:
        e.save_and_commit(state, "A", version=1)
        e.wait_persisted()
        reader = e.open_checkpoint("A").reader("rank00000")
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    caller = FakeStream(0, "caller-side-stream")
    caller.queue(lambda: [t.fill_(float("nan")) for t in targets.values()])
    mark = FakeMark(0, FakeEvent(caller, 1))
    monkeypatch.setattr(staged_read, "stream_marks", lambda tensors: [mark])
    staging = host_cache.HostCache(4 * read_plan.READ_PIECE, read_plan.READ_PIECE, pin=False)
    try:
        staged_read.stream_into(reader.tensor_path, reader.listed, targets, staging, threads=3)
    finally:
        staging.close()
    caller.synchronize()  # what was never waited for runs last
    for name, want in state.items():
        device_scenarios.assert_bits(targets[name], want, name)


# ----------------------------------------------------------------------------- copier.py / device.py
def test_a_file_on_two_gpus_is_ordered_and_synchronised_on_both():
    """Each device's copies wait for that device's kernels and are complete when ``chunk_ready``'s wait returns."""
    cuda = FakeCuda()
    a = cuda.place(torch.zeros(1000), 0)
    b = cuda.place(torch.zeros(3000), 1)
    cuda.queue_kernel(0, lambda: a.fill_(1.0))  # still queued at save time
    cuda.queue_kernel(1, lambda: b.fill_(2.0))
    copier = CudaCopier(device=0, cuda=cuda)
    mark = copier.mark([a, b])
    assert [m.device for m in mark.marks] == [0, 1] and mark.device == 0
    cuda.queue_kernel(1, lambda: b.fill_(-1.0))  # the next step's kernel: after the mark
    copier.begin(mark)
    assert cuda.bound == [0]
    dst = torch.full((4000,), float("nan"))
    raw = dst.view(torch.uint8)
    copier.copy_many([(byte_source(a), 0, 4000, raw[:4000]), (byte_source(b), 0, 12000, raw[4000:])])
    copier.chunk_ready()()
    assert torch.equal(dst[:1000], torch.ones(1000)) and torch.equal(dst[1000:], torch.full((3000,), 2.0))
    copier.finish()
    cuda.drain()


def test_strided_temporaries_live_one_run_at_a_time_not_a_file(tmp_path, monkeypatch):
    """``.contiguous()`` temporaries are made when a tensor's copy starts and dropped once its last
    bytes are queued: never every strided tensor of a file at once."""
    live: weakref.WeakSet = weakref.WeakSet()
    most = []

    class Temporaries(CpuCopier):
        def prepare(self, tensor):
            if tensor.is_contiguous():
                return tensor
            temporary = tensor.contiguous()
            live.add(temporary)
            return temporary

        def copy_many(self, parts):
            most.append(len(live))
            super().copy_many(parts)

    monkeypatch.setattr(pipeline, "make_copier", lambda use_cuda, device=None: Temporaries())
    base = torch.arange(12 * 64 * 64, dtype=torch.float32).reshape(12, 64, 64)
    state = {f"t{i}": base[i].t() for i in range(12)}  # 16 KiB each, strided; the cache holds ~100 KB
    with device_scenarios.engine(tmp_path, **device_scenarios.TINY) as e:
        e.save_and_commit(state, "A", version=1)
        e.wait_persisted()
        loaded = e.load("A")
    for name, want in state.items():
        device_scenarios.assert_bits(loaded[name], want.contiguous(), name)
    assert most and max(most) <= 6, most  # a run is half the cache: at most ~4 tensors, plus the ones it splits
