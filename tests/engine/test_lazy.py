"""Lazy semantics: ``save`` only records references; the copy into the host cache happens in the
background; once ``wait_snapshot`` returns the caller may overwrite its tensors and the checkpoint
still holds the values of save time. No timing assertions: writes are held back with a fault hook
(an Event) so every state checked below is reached deterministically."""

from __future__ import annotations

import threading

import torch

from helpers.states import TINY, assert_same, clone_state


def _gate(fault):
    """Arm a hook that blocks every storage write until the returned Event is set."""
    go = threading.Event()
    entered = threading.Event()

    def hook(level, path, offset, nbytes):
        entered.set()
        assert go.wait(60), "test never released the writer"

    fault(hook)
    return go, entered


def test_mutation_after_wait_snapshot_does_not_reach_checkpoint(make_engine, fault):
    # A cache large enough for the whole snapshot, writes held back: when wait_snapshot returns,
    # not one byte is on disk yet, so what gets written can only come from the host cache.
    engine = make_engine(host_cache_size=0.01, chunk_size_mb=0.05)
    go, entered = _gate(fault)
    state = {"w": torch.randn(300, 300), "b": torch.arange(1000), "t": torch.randn(64, 80).t(),
             "nested": [torch.ones(7, dtype=torch.bfloat16)]}
    expected = clone_state(state)
    fjob = engine.save(state, "c1")
    engine.wait_snapshot()
    assert fjob.snapshot_done.is_set()
    assert entered.wait(30)  # the writer is inside its first write, blocked
    assert "shared" not in fjob.durable_at
    # Training goes on: in-place updates of every saved tensor (also through views).
    state["w"].mul_(-3).add_(1)
    state["b"].zero_()
    state["t"].fill_(7)
    state["nested"][0].copy_(torch.zeros(7))
    engine.commit("c1")
    go.set()
    engine.wait_persisted()
    assert_same(engine.load("c1"), expected)


def test_mutation_after_wait_snapshot_with_cache_smaller_than_state(make_engine):
    # The snapshot streams through a tiny cache: wait_snapshot returns only once every byte was
    # copied (backpressure), so later changes cannot leak in even though flushing is still going on.
    engine = make_engine(**TINY)
    state = {"a": torch.randn(100_000), "b": torch.randn(200, 300).t()}
    expected = []
    for step in range(3):
        expected.append(clone_state(state))
        engine.save(state, f"step{step}", version=step)
        engine.wait_snapshot()
        engine.commit(f"step{step}")
        state["a"].add_(1.0)
        state["b"].mul_(2.0)
    engine.wait_persisted()
    for step in range(3):
        assert_same(engine.load(f"step{step}"), expected[step])
    assert engine.latest() == "step2"


def test_save_only_records_references_copies_happen_in_background(make_engine, fault):
    # Four 4 KiB slots, a 200 KB state and a writer that is held back: the snapshot cannot finish
    # until the test releases it, so save() provably returned without copying the state.
    engine = make_engine(host_cache_size=4 * 4096 / 2 ** 30, chunk_size_mb=0.004)
    assert engine.cache.num_slots == 4
    go, entered = _gate(fault)
    w = torch.randn(50_000)
    fjob = engine.save({"w": w}, "c1")
    assert not fjob.snapshot_done.is_set()
    (span,) = fjob.layout.spans
    assert span.tensor is not None and span.tensor.data_ptr() == w.data_ptr()  # a view, not a copy
    assert fjob.job.files == [fjob] and not fjob.job.commit_requested
    assert entered.wait(30)
    assert not fjob.snapshot_done.is_set()  # blocked behind the writer: backpressure
    go.set()
    engine.wait_snapshot()
    assert fjob.snapshot_done.is_set()
    assert fjob.layout.spans[0].tensor is None  # the caller's tensor is released after the copy
    engine.commit("c1")
    engine.wait_persisted()
    assert torch.equal(engine.load("c1")["w"], w)


def test_save_of_many_tensors_does_not_touch_tensor_data(make_engine, fault):
    # The snapshot is held back; after save() returned every planned span still refers to the
    # caller's own storage (save planned the file from shapes and dtypes, it copied nothing).
    engine = make_engine(host_cache_size=4 * 4096 / 2 ** 30, chunk_size_mb=0.004)
    go, _ = _gate(fault)
    tensors = [torch.full((64,), float(i)) for i in range(2000)]
    fjob = engine.save({"t": tensors}, "c1")
    ptrs = {s.tensor.data_ptr() for s in fjob.layout.spans if s.tensor is not None}
    assert ptrs <= {t.data_ptr() for t in tensors}
    assert not fjob.snapshot_done.is_set()
    go.set()
    engine.commit("c1")
    engine.wait_persisted()
    loaded = engine.load("c1")["t"]
    assert len(loaded) == 2000 and all(torch.equal(a, b) for a, b in zip(loaded, tensors))


def test_wait_snapshot_with_nothing_pending_returns(make_engine):
    engine = make_engine(**TINY)
    assert engine.wait_snapshot() >= 0.0
