"""Sidecar safety: values the safe encoder does not know are refused at save time unless the user
opts into pickle, and a pickled value is only unpickled when the loader allows it."""

from __future__ import annotations

import collections
import enum
import json

import pytest
import torch

from megatron_ext.engine import CheckpointError, EncodeError, UnsafeCheckpointError, read_manifest

from helpers.states import TINY, committed_names


class Opaque:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Opaque and other.value == self.value


class Color(enum.Enum):
    RED = 1
    BLUE = "b"


class Level(enum.IntEnum):
    HIGH = 2


class Key(str):
    pass


Point = collections.namedtuple("Point", "x y")


def test_unknown_class_is_refused_at_save(make_engine, tmp_path):
    engine = make_engine(**TINY)
    with pytest.raises(EncodeError, match=r"cannot store .*Opaque at 'extra/obj' safely.*pickle_fallback"):
        engine.save({"w": torch.ones(3), "extra": {"obj": Opaque(1)}}, "c1")
    with pytest.raises(EncodeError, match="set pickle_fallback"):
        engine.save({"f": lambda: None}, "c2")


def test_pickle_fallback_needs_allow_pickle_to_load(make_engine, tmp_path):
    engine = make_engine(**TINY, pickle_fallback=True)
    state = {"w": torch.arange(10.0), "extra": {"obj": Opaque([1, 2])}}
    engine.save(state, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    sidecar = read_manifest(str(tmp_path / "ckpt" / "c1"))["files"]["rank00000"]["state_file"]
    assert '"$pickle"' in (tmp_path / "ckpt" / sidecar).read_text()
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        engine.load("c1")
    loaded = engine.load("c1", allow_pickle=True)
    assert loaded["extra"]["obj"] == Opaque([1, 2])
    assert torch.equal(loaded["w"], torch.arange(10.0))


COLOR = f"{Color.__module__}.Color"
OPAQUE = f"{Opaque.__module__}.Opaque"
POINT = f"{Point.__module__}.Point"


def test_known_values_need_no_pickle(make_engine, tmp_path):
    engine = make_engine(**TINY, safe_classes=[COLOR])
    state = {"color": Color.BLUE, "red": Color.RED, "pt_plain": tuple(Point(1, 2))}
    engine.save(state, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    loaded = engine.load("c1")
    assert loaded["color"] is Color.BLUE and loaded["red"] is Color.RED and loaded["pt_plain"] == (1, 2)
    sidecar = read_manifest(str(tmp_path / "ckpt" / "c1"))["files"]["rank00000"]["state_file"]
    assert "$pickle" not in (tmp_path / "ckpt" / sidecar).read_text()


def test_safe_classes_store_plain_objects_field_by_field(make_engine, tmp_path):
    engine = make_engine(**TINY, safe_classes=[OPAQUE, POINT, COLOR])
    state = {"obj": Opaque(torch.full((3,), 2.0)), "pt": Point(torch.ones(2), "y"), "c": Color.RED}
    engine.save(state, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    loaded = engine.load("c1")
    assert type(loaded["obj"]) is Opaque and torch.equal(loaded["obj"].value, torch.full((3,), 2.0))
    assert type(loaded["pt"]) is Point and torch.equal(loaded["pt"].x, torch.ones(2)) and loaded["pt"].y == "y"
    assert loaded["c"] is Color.RED
    # A loader that does not allow the class refuses, naming it, instead of building the object.
    other = make_engine(**TINY, read_only=True)
    with pytest.raises(UnsafeCheckpointError, match=r"class test_sidecar\.Opaque, which this loader does not allow"):
        other.load("c1")


def test_classes_off_the_allow_list_are_refused_at_save(make_engine):
    engine = make_engine(**TINY, safe_classes=[OPAQUE])
    with pytest.raises(EncodeError, match=r"cannot store test_sidecar\.Point at 'pt'.*safe_classes"):
        engine.save({"pt": Point(1, 2)}, "c1")
    with pytest.raises(EncodeError, match=r"cannot store test_sidecar\.Color at 'c'"):
        engine.save({"c": Color.RED}, "c1")
    # Subclasses of int and str are not plain values, in a list or as a key (the encoder's fast paths)
    with pytest.raises(EncodeError, match=r"cannot store test_sidecar\.Level at 'l/1'"):
        engine.save({"l": [1, Level.HIGH]}, "c1")
    with pytest.raises(EncodeError, match=r"cannot store test_sidecar\.Key at 'd'"):
        engine.save({"d": {Key("k"): 1}}, "c1")


def test_sidecar_is_plain_json(make_engine, tmp_path):
    engine = make_engine(**TINY)
    engine.save({"w": torch.ones(2), "lr": 0.5, "k": {1: "a"}}, "c1")
    engine.commit("c1")
    engine.wait_persisted()
    sidecar = read_manifest(str(tmp_path / "ckpt" / "c1"))["files"]["rank00000"]["state_file"]
    doc = json.loads((tmp_path / "ckpt" / sidecar).read_text())
    assert doc == {"format": "megatron_ext.state",
                   "state": {"w": {"$t": "w"}, "lr": 0.5, "k": {"$dict": [[1, "a"]]}}}


@pytest.mark.parametrize("bad", [{"obj": Opaque(1)}, {"c": torch.zeros(2, dtype=torch.complex128)}],
                         ids=["unknown_class", "unsupported_dtype"])
def test_failed_save_leaves_no_checkpoint_behind(make_engine, tmp_path, bad):
    engine = make_engine(**TINY)
    engine.save({"w": torch.ones(3)}, "good", version=1)
    engine.commit("good")
    engine.wait_persisted()
    with pytest.raises((EncodeError, TypeError)):
        engine.save(bad, "bad", version=2)
    engine.shutdown()
    assert committed_names(tmp_path / "ckpt") == ["good"]
    assert engine.latest() == "good"
    with pytest.raises(CheckpointError):
        engine.load("bad")
