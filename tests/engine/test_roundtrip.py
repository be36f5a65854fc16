"""Bit-exact round trips through the real engine: dtypes, odd tensor shapes and strides, caches
much smaller than the state, nested Python containers, RNG states; and the files are plain
safetensors that the ``safetensors`` library reads."""

from __future__ import annotations

import argparse
import collections
import json
import random
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers.states import TINY, assert_same, assert_tensor_exact, clone_state

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64, torch.uint8]


def _make(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _roundtrip(engine, state, checkpoint="c1", name=None, **load_kwargs):
    expected = clone_state(state)
    engine.save(state, checkpoint, name)
    engine.commit(checkpoint)
    engine.wait_persisted()
    loaded = engine.load(checkpoint, name, **load_kwargs)
    assert_same(loaded, expected)
    return loaded


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtype_roundtrip_bit_exact(make_engine, dtype):
    engine = make_engine(**TINY)
    state = {"a": _make(dtype, (37, 129), 1), "scalar": _make(dtype, (), 2), "vec": _make(dtype, (5000,), 3)}
    _roundtrip(engine, state)


def test_mixed_dtypes_in_one_file_and_special_floats(make_engine):
    engine = make_engine(**TINY)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    state = {dt_name: _make(dt, (333,), i) for i, (dt_name, dt) in
             enumerate((str(d).removeprefix("torch."), d) for d in DTYPES)}
    state["special_f32"] = special
    state["special_bf16"] = special.to(torch.bfloat16)
    state["special_f64"] = special.double()
    _roundtrip(engine, state)


def test_non_contiguous_views_cross_chunk_boundaries(make_engine):
    engine = make_engine(**TINY)
    assert engine.cache.chunk_bytes == 4096
    base = torch.arange(64 * 97, dtype=torch.float32).reshape(64, 97)
    cube = torch.randn(11, 13, 17, dtype=torch.float64)
    state = {
        "transposed": base.t(),                                   # 24 KB, column-major
        "strided": torch.arange(20001, dtype=torch.int64)[::2],   # 1-D, stride 2
        "rows_strided": base[::3, 5:90],                          # 2-D, both dims strided
        "expanded": torch.arange(1500, dtype=torch.float32).expand(7, 1500),  # stride 0
        "broadcast_col": torch.arange(9, dtype=torch.float16).reshape(9, 1).expand(9, 3000),
        "permuted3d": cube.permute(2, 0, 1),
        "permuted3d_sliced": cube.permute(1, 2, 0)[:, ::2, 1:],
        "bf16_t": torch.randn(50, 77).to(torch.bfloat16).t(),
        "bool_t": (torch.randn(61, 67) > 0).t(),
    }
    for k, v in state.items():
        if k != "strided":
            assert not v.is_contiguous(), k
    assert not state["strided"].is_contiguous()
    loaded = _roundtrip(engine, state)
    for k, v in loaded.items():
        assert v.is_contiguous(), k  # loaded tensors are fresh, dense tensors


def test_views_sharing_storage_come_back_equal_and_independent(make_engine):
    engine = make_engine(**TINY)
    base = torch.randn(100, 60)
    state = {"base": base, "same": base, "row_view": base[10:20], "t_view": base.t(), "col": base[:, 3]}
    loaded = _roundtrip(engine, state)
    assert loaded["base"].data_ptr() != loaded["same"].data_ptr()
    loaded["base"].zero_()
    assert_tensor_exact(loaded["same"], base)
    assert_tensor_exact(loaded["row_view"], base[10:20])
    assert_tensor_exact(loaded["t_view"], base.t())


def test_empty_and_zero_dim_tensors(make_engine):
    engine = make_engine(**TINY)
    state = {
        "empty_f32": torch.empty(0),
        "empty_2d": torch.empty(0, 5, dtype=torch.float64),
        "empty_mid": torch.empty(3, 0, 4, dtype=torch.int64),
        "empty_bool": torch.empty(0, dtype=torch.bool),
        "zero_dim_f32": torch.tensor(3.25),
        "zero_dim_i64": torch.tensor(-(2 ** 62), dtype=torch.int64),
        "zero_dim_bool": torch.tensor(True),
        "zero_dim_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "after": torch.arange(10, dtype=torch.uint8),
    }
    _roundtrip(engine, state)


def test_state_with_only_empty_tensors_and_with_no_tensors(make_engine):
    engine = make_engine(**TINY)
    _roundtrip(engine, {"e": torch.empty(0)}, "only_empty")
    _roundtrip(engine, {"step": 3, "lr": 0.5, "names": ["a", "b"]}, "no_tensors")


def test_tensor_larger_than_the_whole_cache(make_engine):
    engine = make_engine(**TINY)
    big = torch.randn(300_000)  # 1.2 MB through a ~105 KB cache
    assert big.numel() * 4 > engine.cache.nbytes * 10
    _roundtrip(engine, {"big": big, "big_t": torch.randn(700, 300).t(), "small": torch.ones(3)})


def test_cache_far_smaller_than_state_with_many_files(make_engine):
    engine = make_engine(**TINY)
    states = {f"part{i}": {"w": torch.randn(40_000 + i), "i": torch.arange(i + 1)} for i in range(4)}
    expected = clone_state(states)
    for name, st in states.items():
        engine.save(st, "c1", name)
    engine.commit("c1")
    engine.wait_persisted()
    for name in states:
        assert_same(engine.load("c1", name), expected[name])


def test_many_small_tensors_header_spans_many_chunks(make_engine, tmp_path):
    engine = make_engine(**TINY)
    state = {f"layer{i}.weight": torch.full((i % 7 + 1,), float(i)) for i in range(1200)}
    state["counts"] = [torch.tensor(i, dtype=torch.int64) for i in range(300)]
    fjob = engine.save(clone_state(state), "c1")
    assert fjob.layout.data_start > 5 * engine.cache.chunk_bytes  # header alone spans many chunks
    engine.commit("c1")
    engine.wait_persisted()
    assert_same(engine.load("c1"), state)


def test_nested_python_containers_and_rng_states(make_engine):
    engine = make_engine(**TINY)
    random.seed(1234)
    np.random.seed(4321)
    torch.manual_seed(99)
    ns = argparse.Namespace(lr=3e-4, layers=24, name="gpt", betas=(0.9, 0.95), flag=False, none=None)
    state = {
        "model": collections.OrderedDict([("w", torch.randn(10, 10)), ("b", torch.zeros(10))]),
        "opt": {"state": {0: {"exp_avg": torch.randn(10), "step": torch.tensor(5.0)}}, "param_groups": [
            {"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.999)}]},
        "args": ns,
        "tuple_of_lists": ([1, 2.5, None], [True, "x"], ()),
        "nested_list": [[torch.ones(2)], [[torch.zeros(1, dtype=torch.int64)]], []],
        "numpy": {"f32": np.arange(12, dtype=np.float32).reshape(3, 4),
                  "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
                  "bool": np.array([True, False]), "u64": np.array([2 ** 63], dtype=np.uint64)},
        "np_scalars": [np.float64(1.25), np.int32(-3), np.bool_(True)],
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "big_int": 2 ** 80, "neg": -1, "float": 0.1, "nan": float("nan"), "inf": float("-inf"),
        "unicode": "héllo ✓", "bytes": b"\x00\xff", "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
        "$dollar": "key starting with $", "empty_dict": {}, "empty_od": collections.OrderedDict(),
        "sets": {1, 2, 3}, "fz": frozenset({"a"}),
    }
    expected = clone_state(state)
    loaded = _roundtrip(engine, state)
    assert loaded["dtype"] is torch.bfloat16
    # RNG states restore exactly: the generators continue with the same draws.
    random.setstate(loaded["rng"]["python"])
    np.random.set_state(loaded["rng"]["numpy"])
    torch.set_rng_state(loaded["rng"]["torch"])
    draws = (random.random(), np.random.rand(), torch.rand(3))
    random.setstate(expected["rng"]["python"])
    np.random.set_state(expected["rng"]["numpy"])
    torch.set_rng_state(expected["rng"]["torch"])
    assert draws[0] == random.random() and draws[1] == np.random.rand() and torch.equal(draws[2], torch.rand(3))


def test_zero_dim_numpy_array_keeps_its_shape(make_engine):
    engine = make_engine(**TINY)
    _roundtrip(engine, {"scalar0d": np.array(7.5), "int0d": np.array(3, dtype=np.int8)})


def test_non_str_dict_keys(make_engine):
    engine = make_engine(**TINY)
    state = {
        0: torch.arange(5), 1: "one", -7: [1], 2.5: "float key", True: "bool key", None: "none key",
        (1, "a"): torch.ones(2), "1": torch.zeros(3),  # "1" and 1 map to the same tensor path
        "inner": {3: {4: torch.full((2,), 4.0)}, "x": 1},
    }
    loaded = _roundtrip(engine, state)
    assert set(loaded) == set(state)
    assert_tensor_exact(loaded[(1, "a")], torch.ones(2))
    assert_tensor_exact(loaded["1"], torch.zeros(3))


def test_non_tensor_values_are_captured_at_save_time(make_engine):
    engine = make_engine(**TINY)
    state = {"step": 1, "meta": {"lr": 0.1}, "w": torch.ones(4)}
    engine.save(state, "c1")
    state["step"] = 2
    state["meta"]["lr"] = 99.0
    engine.wait_snapshot()
    engine.commit("c1")
    engine.wait_persisted()
    loaded = engine.load("c1")
    assert loaded["step"] == 1 and loaded["meta"] == {"lr": 0.1}


# ---------------------------------------------------------------------------- safetensors files
def test_files_load_with_safetensors_library_and_data_is_4k_aligned(make_engine, tmp_path):
    engine = make_engine(**TINY)
    state = {
        "f32": torch.randn(123, 45), "bf16": torch.randn(1000).to(torch.bfloat16), "i64": torch.arange(777),
        "bool": torch.rand(99) > 0.5, "u8": torch.randint(0, 255, (4097,), dtype=torch.uint8),
        "f64_t": torch.randn(30, 40, dtype=torch.float64).t(), "scalar": torch.tensor(2.0),
        "empty": torch.empty(0, 3), "f16": torch.randn(17).half(),
    }
    expected = {k: v.contiguous() for k, v in clone_state(state).items()}
    engine.save(state, "c1", "model")
    engine.commit("c1")
    engine.wait_persisted()
    manifest = json.loads((tmp_path / "ckpt" / "c1" / "manifest.json").read_text())
    path = tmp_path / "ckpt" / manifest["files"]["model"]["tensor_file"]
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["name"] == "model" and header["__metadata__"]["run_id"] == engine.run_id
    # One format version: the tensor file's header says it as a string, the manifest as an int.
    assert header["__metadata__"]["format_version"] == str(manifest["format_version"]) == "3"
    assert len(raw) == manifest["files"]["model"]["size"]

    tensors = load_file(str(path))
    assert set(tensors) == set(expected)
    for k, v in expected.items():
        assert_tensor_exact(tensors[k], v, k)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(expected)
        assert f.metadata()["checkpoint"] == "c1"
        for k, v in expected.items():
            assert_tensor_exact(f.get_tensor(k), v, k)
        assert_tensor_exact(f.get_slice("f32")[3:7], expected["f32"][3:7], "slice")


def test_map_location_and_open_checkpoint_part(make_engine):
    engine = make_engine(**TINY)
    state = {"model": {"w": torch.randn(50, 50)}, "opt": {"m": torch.randn(50)}, "step": 4}
    expected = clone_state(state)
    engine.save(state, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    loaded = engine.load("c1", map_location="cpu")
    assert_same(loaded, expected)
    ckpt = engine.open_checkpoint("c1")
    assert_same(ckpt.reader("rank00000").part("model"), expected["model"])
    assert_tensor_exact(ckpt.reader("rank00000").tensor("opt/m"), expected["opt"]["m"])


def test_round_trip_with_default_cache_and_chunks(make_engine):
    engine = make_engine(host_cache_size=0.01, chunk_size_mb=1)
    state = {"w": torch.randn(512, 1024), "t": torch.randn(256, 300).t(), "b": torch.arange(3)}
    _roundtrip(engine, state)


# ---------------------------------------------------------------------------- edge cases found by probing
def test_complex64_and_non_contiguous_conjugate_views(make_engine):
    engine = make_engine(**TINY)
    z = torch.randn(40, 50, dtype=torch.complex64)
    state = {"c64": z, "conj_t": z.conj().t(), "neg_imag": z.conj().imag}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    engine.save(state, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    assert_same(engine.load("c1"), expected)


def test_contiguous_conjugate_view_round_trips(make_engine):
    engine = make_engine(**TINY)
    z = torch.randn(3000, dtype=torch.complex64)
    engine.save({"zc": z.conj()}, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    assert_same(engine.load("c1"), {"zc": z.conj().resolve_conj()})


def test_state_key_named_metadata(make_engine, tmp_path):
    engine = make_engine(**TINY)
    state = {"__metadata__": torch.arange(4.0), "w": torch.ones(3)}
    engine.save(clone_state(state), "c1")
    engine.commit("c1")
    engine.wait_persisted()
    assert_same(engine.load("c1"), state)
    entry = engine.open_checkpoint("c1").manifest["files"]["rank00000"]
    load_file(str(tmp_path / "ckpt" / entry["tensor_file"]))
