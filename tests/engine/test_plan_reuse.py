"""``save(..., reuse=True)``: a file saved again with the same tensors reuses its plan (views and
layout), and every change of structure plans it afresh; either way each checkpoint loads bit for bit
as it was at its save. Non-tensor values are always encoded anew."""

from __future__ import annotations

import torch

from megatron_ext.engine.format import tensor_file
from megatron_ext.engine.save.flow.file_plan import PlannedFile, tensor_signatures

from helpers.states import TINY, assert_same, clone_state


def _state(step: int, params: dict[str, torch.Tensor]) -> dict:
    return {"params": params, "step": step, "lr": 0.1 / (step + 1), "rng": (3, tuple(range(step, step + 5)), None),
            "meta": {"w": {"shape": [4, 8], "offset": [0, step]}}}


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 8, generator=g), "b": torch.randn(8, generator=g).to(torch.bfloat16),
            "t": torch.randn(6, 5, generator=g).t(), "i": torch.arange(7)}


def _save_all(engine, states: list[tuple[str, dict]]) -> list:
    """Save each (checkpoint, state) with reuse, each one's copies done before the state changes."""
    expected = []
    for checkpoint, state in states:
        expected.append((checkpoint, clone_state(state)))
        engine.save(state, checkpoint, "rank00000", reuse=True)
        engine.commit(checkpoint)
        engine.wait_snapshot()
    engine.wait_persisted()
    return expected


def _check(engine, expected) -> None:
    for checkpoint, state in expected:
        assert_same(engine.load(checkpoint, "rank00000"), state)


def test_same_tensors_reuse_the_plan_and_values_are_fresh(make_engine):
    engine = make_engine(**TINY)
    params = _params()
    states = []
    for step in range(4):
        with torch.no_grad():  # the training step: values change in place, the structure does not
            for t in params.values():
                t.add_(1)
        states.append((f"iter_{step:07d}", _state(step, params)))
        engine.save(states[-1][1], states[-1][0], "rank00000", reuse=True)
        expected = clone_state(states[-1][1])
        engine.commit(states[-1][0])
        engine.wait_snapshot()
        states[-1] = (states[-1][0], expected)
    engine.wait_persisted()
    assert (engine.plan_reuses, engine.views_renewed) == (3, 0)
    _check(engine, states)


def test_a_changed_structure_plans_afresh_and_saves_exactly(make_engine):
    engine = make_engine(**TINY)
    params = _params()
    steps = [("c0", _state(0, dict(params)))]
    steps.append(("c1", _state(1, dict(params))))  # reused
    steps.append(("c2", _state(2, {**params, "new": torch.ones(3)})))  # a new tensor (optimizer state appears)
    grown = dict(params)
    grown["w"] = params["w"].clone()
    grown["w"].resize_(5, 8).fill_(2.0)
    steps.append(("c3", _state(3, grown)))  # a resized tensor
    half = {**grown, "b": grown["b"].to(torch.float16)}
    steps.append(("c4", _state(4, half)))  # a dtype change
    other = {**half, "i": torch.arange(7) * 3}  # another object of the same shape: copied from the new one
    steps.append(("c5", _state(5, other)))  # the layout is reused, "i" gets a view of its new memory
    steps.append(("c6", _state(6, {k: other[k] for k in reversed(other)})))  # the same tensors, another order
    renamed = dict(other)
    renamed["j"] = renamed.pop("i")
    steps.append(("c7", _state(7, renamed)))  # a renamed tensor
    steps.append(("c8", _state(8, renamed)))  # reused again
    expected = _save_all(engine, steps)
    assert (engine.plan_reuses, engine.views_renewed) == (3, 1)  # c1, c5 (its new "i"), c8
    _check(engine, expected)


def test_a_view_of_other_memory_gets_a_new_view(make_engine):
    engine = make_engine(**TINY)
    base = torch.arange(20, dtype=torch.float32)
    steps = [("c0", {"v": base[0:10]}), ("c1", {"v": base[0:10]}), ("c2", {"v": base[5:15]}),
             ("c3", {"v": base[0:20:2]}), ("c4", {"v": base.view(2, 10)[:, :5]})]
    expected = _save_all(engine, steps)
    # c1: a new view object of the same memory; c2: the same shape in other memory, c3 with other strides
    # (each a new view); c4: another shape, planned afresh
    assert (engine.plan_reuses, engine.views_renewed) == (3, 2)
    _check(engine, expected)


def test_without_reuse_nothing_is_kept(make_engine):
    engine = make_engine(**TINY)
    params = _params()
    for checkpoint in ("c0", "c1"):
        engine.save(_state(0, params), checkpoint)
        engine.commit(checkpoint)
        engine.wait_snapshot()
    engine.wait_persisted()
    assert engine.plan_reuses == 0 and not engine._plans


def test_the_reused_layout_is_the_fresh_one():
    """Byte for byte the header and offsets a fresh plan gives, also when the metadata's length moves
    the data start to another 4 KiB block."""
    params = {f"p{i}": torch.zeros(i + 1, dtype=torch.float32 if i % 2 else torch.bfloat16) for i in range(150)}
    first = PlannedFile.encode(params, "c", "rank00000", 0, "a" * 12, pickle_fallback=False, classes=None,
                               reusable=True)
    short = tensor_file.plan(list(params.items()), {"checkpoint": "c", "name": "rank00000", "rank": "0",
                                                    "run_id": "a" * 12})
    room = short.data_start - (len(short.header.rstrip(b" ")))  # the padding: one more character crosses a block
    starts = set()
    for checkpoint in ("c", "c" * (room + 1), "c" * (room + 2), "d"):
        again = PlannedFile.encode(params, checkpoint, "rank00000", 0, "a" * 12, pickle_fallback=False, classes=None,
                                   previous=first.plan)
        assert again.reused
        fresh = tensor_file.plan(list(params.items()), {"checkpoint": checkpoint, "name": "rank00000", "rank": "0",
                                                       "run_id": "a" * 12})
        assert again.layout.header == fresh.header and again.layout.size == fresh.size
        assert [(s.name, s.dtype, s.shape, s.start, s.end) for s in again.layout.spans] == \
            [(s.name, s.dtype, s.shape, s.start, s.end) for s in fresh.spans]
        starts.add(fresh.data_start)
    assert len(starts) == 2


def test_signatures_refuse_what_cannot_be_reused():
    class Sub(torch.Tensor):
        pass

    assert tensor_signatures([("a", torch.zeros(2))]) is not None
    assert tensor_signatures([("a", torch.nn.Parameter(torch.zeros(2)))]) is not None
    assert tensor_signatures([("a", torch.zeros(2).as_subclass(Sub))]) is None
    assert tensor_signatures([("a", torch.zeros(2, dtype=torch.complex64).conj())]) is None
    assert tensor_signatures([("a", torch.zeros(2, 2).to_sparse())]) is None


def test_the_same_object_changed_in_place_is_planned_afresh(make_engine):
    """A tensor object whose memory or shape changes in place (``set_``, ``resize_``, ``.data =``)."""
    engine = make_engine(**TINY)
    t = torch.arange(12, dtype=torch.float32)
    expected = _save_all(engine, [("c0", {"t": t}), ("c1", {"t": t})])  # c1 reused
    with torch.no_grad():
        t.set_(torch.full((12,), 5.0))  # same shape, other memory
    expected += _save_all(engine, [("c2", {"t": t})])
    with torch.no_grad():
        t.resize_(3, 4)
    expected += _save_all(engine, [("c3", {"t": t})])
    t.data = torch.ones(3, 4, dtype=torch.float64)
    expected += _save_all(engine, [("c4", {"t": t}), ("c5", {"t": t})])
    assert (engine.plan_reuses, engine.views_renewed) == (3, 1)  # c1, c2 (other memory: a new view), c5
    _check(engine, expected)


def test_tensors_in_new_memory_each_save_get_new_views(make_engine):
    """An RNG state (``torch.get_rng_state()``: a new tensor at each call) beside kept weights."""
    engine = make_engine(**TINY)
    w = torch.randn(16, 16)
    expected = []
    for step in range(3):
        torch.rand(step + 1)  # the generator moves
        expected += _save_all(engine, [(f"c{step}", {"w": w, "rng": torch.get_rng_state(), "step": step})])
        with torch.no_grad():
            w.mul_(2)
    assert (engine.plan_reuses, engine.views_renewed) == (2, 2)
    _check(engine, expected)


def test_a_frozen_value_is_saved_as_itself_and_its_encoding_reused(make_engine):
    from megatron_ext.engine import Frozen

    engine = make_engine(**TINY)
    meta = Frozen({"w": {"shape": [4, 8], "offset": [0, 0]}, "names": ("a", "b")})
    t = torch.ones(2)
    with_tensor = Frozen({"t": t})
    w = torch.randn(4, 8)
    expected = _save_all(engine, [("c0", {"w": w, "meta": meta, "t": with_tensor}),
                                  ("c1", {"w": w, "meta": meta, "t": with_tensor})])
    kept = engine._plans["rank00000"].frozen
    assert set(kept) == {id(meta), id(with_tensor)}
    text = kept[id(meta)][1]
    t.fill_(3.0)  # a Frozen's tensors are the same objects: their values are read at each save
    expected += _save_all(engine, [("c2", {"w": w, "meta": meta, "t": with_tensor})])
    assert engine._plans["rank00000"].frozen[id(meta)][1] is text, "encoded once"
    t.data = torch.full((2,), 5.0)  # the same tensor in new memory: the plan gives it a new view
    expected += _save_all(engine, [("c3", {"w": w, "meta": meta, "t": with_tensor})])
    # The same Frozen elsewhere in the state: walked there (its tensors' names are of that place).
    expected += _save_all(engine, [("c4", {"w": w, "meta": meta, "moved": with_tensor})])
    values = {"c0": 1.0, "c1": 1.0, "c2": 3.0, "c3": 5.0, "c4": 5.0}
    for checkpoint, _ in expected:
        state = engine.load(checkpoint, "rank00000")
        assert state["meta"] == {"w": {"shape": [4, 8], "offset": [0, 0]}, "names": ("a", "b")}
        got = state["moved" if checkpoint == "c4" else "t"]["t"]
        assert torch.equal(got, torch.full((2,), values[checkpoint])), (checkpoint, got)
        assert torch.equal(state["w"], w)
    assert engine.load("c0", "rank00000").keys() == {"w", "meta", "t"}
    assert engine.load("c4", "rank00000").keys() == {"w", "meta", "moved"}
