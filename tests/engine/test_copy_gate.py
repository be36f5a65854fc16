"""A save given a ``CopyGate``: nothing is copied before it opens, so values written into the saved
tensors between the save and ``open()`` (a collective filling in a shard) reach the checkpoint;
a wait that finds it shut settles it first; an abnormal end fails the copy instead of writing
unfinished values. Deterministic: the gate itself orders every step."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.engine import CheckpointError, CopyGate

from helpers.states import assert_same, clone_state


def test_values_filled_in_before_open_reach_the_checkpoint(make_engine):
    engine = make_engine()
    state = {"w": torch.zeros(4096), "b": torch.arange(100, dtype=torch.float32)}
    gate = CopyGate(settle=lambda: pytest.fail("the gate was opened, no wait should settle it"))
    fjob = engine.save(state, "c1", gate=gate)
    engine.commit("c1")
    assert not fjob.snapshot_done.wait(0.3)  # held: not one chunk copied while the gate is shut
    state["w"][2048:] = 5.0  # the "all-gather" lands after the save returned
    gate.open()
    expected = clone_state(state)
    engine.wait_snapshot()
    state["w"].fill_(-1)  # the next optimizer step
    engine.wait_persisted()
    assert_same(engine.load("c1"), expected)


def test_a_wait_before_open_settles_the_gate_on_the_calling_thread(make_engine):
    engine = make_engine()
    state = {"w": torch.zeros(1000)}
    settled = []

    def settle():
        state["w"].fill_(3.0)  # the blocking all-gather, run by the wait
        settled.append(True)

    engine.save(state, "c1", gate=CopyGate(settle))
    engine.commit("c1")
    engine.wait_snapshot()
    assert settled == [True]
    state["w"].zero_()
    engine.wait_persisted()
    assert torch.equal(engine.load("c1")["w"], torch.full((1000,), 3.0))


def test_wait_persisted_settles_too(make_engine):
    engine = make_engine()
    state = {"w": torch.zeros(10)}
    engine.save(state, "c1", gate=CopyGate(lambda: state["w"].fill_(2.0)))
    engine.commit("c1")
    engine.wait_persisted()
    assert torch.equal(engine.load("c1")["w"], torch.full((10,), 2.0))


def test_abnormal_end_fails_the_held_copy_and_commits_nothing(make_engine):
    engine = make_engine()
    gate = CopyGate(lambda: pytest.fail("no collective may run at an abnormal end"))
    engine.save({"w": torch.zeros(10)}, "c1", gate=gate)
    engine.commit("c1")
    with pytest.raises(CheckpointError, match="cancelled"):
        engine.shutdown(timeout=10, normal_end=False)
    assert engine.latest() is None


def test_a_gate_never_opened_is_an_error_not_a_hang(make_engine):
    engine = make_engine(persist_timeout_s=1)
    engine.save({"w": torch.zeros(10)}, "c1", gate=CopyGate(lambda: None, what="the test's values"))
    with pytest.raises(CheckpointError, match="the test's values"):
        _wait_for_failure(engine)


def test_a_gate_serves_one_save():
    gate = CopyGate(lambda: None)
    gate.bind(lambda: None)
    with pytest.raises(CheckpointError, match="one save"):
        gate.bind(lambda: None)


def _wait_for_failure(engine) -> None:
    """The snapshot thread's timeout reaches the training thread at its next call."""
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine.raise_if_failed()
        time.sleep(0.05)
    pytest.fail("the held copy never timed out")


def test_abnormal_end_copies_a_gate_whose_values_are_final_already(make_engine):
    """``ready``: the collective completed, nothing needs to run, so the exception's end still commits."""
    engine = make_engine()
    state = {"w": torch.full((10,), 4.0)}
    gate = CopyGate(lambda: pytest.fail("no collective may run at an abnormal end"), ready=lambda: True)
    engine.save(state, "c1", gate=gate)
    engine.commit("c1")
    engine.shutdown(timeout=10, normal_end=False)
    assert engine.latest() == "c1"


def test_finish_at_the_end():
    """What the exit hook does with a shut gate: settle only where collectives may run; a settle
    that fails cancels the copy (reported), never raises into the exit."""
    ran = []
    assert CopyGate(lambda: ran.append(1)).finish(collectives_ok=True) == "settled" and ran == [1]
    shut = CopyGate(lambda: ran.append(2))
    assert shut.finish(collectives_ok=False) == "cancelled" and ran == [1] and "exception" in shut.cancel_reason

    def broken() -> None:
        raise RuntimeError("peer gone")

    failed = CopyGate(broken)
    assert failed.finish(collectives_ok=True) == "cancelled" and "peer gone" in failed.cancel_reason
    with pytest.raises(CheckpointError, match="peer gone"):
        failed.wait(0.0, lambda: None)


def test_the_tests_hold_on_copies_is_a_gate_only_the_wait_opens(make_engine, monkeypatch):
    """``faults.hold_copies_until_wait`` (the Megatron-LM harness's ``late_copies``): every save's copies
    wait behind a ``CopyGate`` until the training thread's wait, so a change made before it is in the
    checkpoint; a caller's own gate is settled by that wait too, and shutdown opens what no wait did."""
    from megatron_ext.engine import faults

    monkeypatch.setattr(faults, "_holding", True)
    engine = make_engine()
    state = {"w": torch.zeros(2048)}
    fjob = engine.save(state, "c1", version=1)
    engine.commit("c1")
    assert not fjob.snapshot_done.wait(0.3)  # held: nothing copied before the wait
    state["w"].fill_(1.0)  # e.g. finalize_model_grads updating a router's bias before the step
    engine.wait_snapshot()
    state["w"].fill_(-1.0)
    settled = []
    own = CopyGate(settle=lambda: (state["w"].fill_(2.0), settled.append(True)))
    engine.save(state, "c2", version=2, gate=own)
    engine.commit("c2")
    engine.wait_snapshot()
    assert settled == [True]
    later = engine.save({"x": torch.ones(8)}, "c3", version=3)
    engine.commit("c3")
    engine.wait_persisted()
    assert later.snapshot_done.is_set()
    assert torch.equal(engine.load("c1")["w"], torch.ones(2048))
    assert torch.equal(engine.load("c2")["w"], torch.full((2048,), 2.0))


def test_abandon_cancels_held_copies_commits_nothing_and_frees_the_directory(make_engine, tmp_path):
    """An in-process restart's first step: the failed attempt's engine stops at once (its open
    checkpoint with it) and leaves nothing that keeps a new engine in this process from starting."""
    engine = make_engine()
    engine.save({"w": torch.zeros(4096)}, "c0")
    engine.commit("c0")
    engine.wait_persisted()
    engine.save({"w": torch.ones(4096)}, "c1", gate=CopyGate(settle=lambda: pytest.fail("abandon settles nothing")))
    engine.commit("c1")
    left = engine.abandon("a test's restart")
    assert left == {"open": ["c1"], "running": [], "cache_freed": True}
    with pytest.raises(CheckpointError, match="abandoned: a test's restart"):
        engine.save({"w": torch.ones(1)}, "c2")
    again = make_engine()  # the same directory: its lock was released, the open checkpoint swept away
    assert again.latest() == "c0" and not (tmp_path / "ckpt" / "c1").exists()
    assert_same(again.load("c0"), {"w": torch.zeros(4096)})
