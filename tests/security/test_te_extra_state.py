"""Transformer Engine's pickled extra state is checked before any module unpickles it (``te_extra_state``).

Genuine extra state is built as TE 2.9-2.11 write it (``helpers.te_shapes``, which says from
which TE file each shape comes) for every recipe, for modules and fusible ops, and TE 1.x's
``BytesIO``; it passes and decodes to the values it was made from. Hostile extra state (a pickle
that would run ``touch <canary>``, through the outer pickle, the nested ``torch.save`` bytes of a
tensor's storage, a ``BytesIO``, a TorchScript archive, or callables hidden in recipe fields) is
refused with an ``UnsafeCheckpointError`` naming the file and the module, and nothing runs (the
audit hook sees no process, and the canary never appears).
"""

from __future__ import annotations

import collections
import fractions
import io
import pickle
from pathlib import Path

import pytest
import torch

from megatron_ext.engine import CheckpointEngine, CheckpointError, UnsafeCheckpointError
from megatron_ext import te_extra_state as tes

from helpers import te_shapes

RECIPES = te_shapes.all_recipes()
FILE = "/ckpt/iter_0000003/rank00000.0123456789ab.safetensors"


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check(value, key: str = "decoder.layers.0.self_attention.linear_qkv._extra_state") -> int:
    return tes.check_extra_state({key: value}, allow_pickle=False, where=FILE)


# ------------------------------------------------------------------------------ genuine
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("kind", ["module", "ops"])
def test_genuine_te_extra_state_passes_and_decodes_to_its_values(name, kind):
    recipe = RECIPES[name]
    if kind == "module":
        blob, state = te_shapes.module_extra_state(recipe, num_gemms=2, seed=1), te_shapes.module_state(recipe, 2, 1)
    else:
        blob, state = te_shapes.ops_extra_state(recipe, seed=1), te_shapes.ops_state(recipe, 1)
    assert blob.dtype == torch.uint8 and blob.numel() > 0
    assert check(blob) == 1
    with te_shapes.te_recipe_module():  # TE imported: its own recipe objects come back
        decoded = tes.decode_extra_state(blob)
    assert equal(decoded, state)
    records = tes.decode_extra_state(blob)  # TE not imported: inert records of the same fields
    recipe_record = records["recipe"] if kind == "module" else records["forward"]["recipe"]
    assert isinstance(recipe_record, tes.TERecord) and recipe_record.te_class == type(recipe).__name__
    assert recipe_record.fields["fp8_format"].name == recipe.fp8_format.name


def test_delayed_scaling_tensors_are_the_saved_values():
    recipe = te_shapes.DelayedScaling(amax_history_len=5)
    decoded = tes.decode_extra_state(te_shapes.module_extra_state(recipe, num_gemms=3, seed=7))
    expected = te_shapes.module_state(recipe, 3, 7)
    assert decoded["scale_fwd"].shape == (9,) and decoded["amax_history_bwd"].shape == (5, 6)
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert equal(decoded[key], expected[key])


def test_te1_bytesio_extra_state_passes():
    assert check(te_shapes.te1_extra_state(seed=2)) == 1
    assert equal(tes.decode_extra_state(te_shapes.te1_extra_state(seed=2)), te_shapes.te1_state(seed=2))


def test_empty_and_absent_extra_state_are_not_pickles():
    state = {"a._extra_state": te_shapes.no_fp8_extra_state(), "b._extra_state": None,
             "c._extra_state": {"modelopt": "plain values the sidecar decoded"}, "d.weight": torch.ones(2)}
    assert tes.check_extra_state(state, allow_pickle=False, where=FILE) == 0


def test_every_extra_state_key_is_checked_grouped_linear_and_nested():
    blob = te_shapes.module_extra_state(RECIPES["delayed_tuned"])
    state = {"model": {"decoder.layers.0.mlp.experts.linear_fc1._extra_state": blob,
                       "decoder.layers.0.mlp.experts.linear_fc1._extra_state1": blob,
                       "decoder.layers.0.mlp.experts.linear_fc1._extra_state7": blob,
                       "decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.ones(1),
                       "_extra_state_not": blob, "x._extra_statex": blob}}
    assert tes.check_extra_state(state, allow_pickle=False, where=FILE) == 3


# ------------------------------------------------------------------------------ hostile
class _Call:
    """Pickles as ``func(*args)``: how an attacker spells a call in a pickle."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _te_tensor_pickle_with_storage_bytes(storage_bytes: bytes, size=(3,)) -> _Call:
    """A tensor pickled as TE's are, around nested ``torch.save`` bytes of the attacker's choosing."""
    return _Call(torch._utils._rebuild_tensor_v2, _Call(torch.storage._load_from_bytes, storage_bytes), 0, size, (1,),
                 False, collections.OrderedDict())


def _with_extra(value) -> torch.Tensor:
    state = te_shapes.module_state(te_shapes.DelayedScaling(amax_history_len=4))
    state["extra_fp8_variables"]["injected"] = value
    return te_shapes._as_te_blob(state)


def _legacy_save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def _zip_save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _torchscript() -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    return buffer.getvalue()


def _inflated_storage_bytes() -> bytes:
    """Genuine nested bytes of a 3-float storage whose record claims 2**28 elements (1 GiB)."""
    data = _legacy_save(torch.ones(3).storage())
    marker = b"cpuq\x03K\x03N"
    assert data.count(marker) == 1
    return data.replace(marker, b"cpuq\x03J\x00\x00\x00\x10N")


def hostile(command: str) -> dict[str, tuple[object, str]]:
    """name -> (extra state value, what the refusal must say)."""
    canary = te_shapes.Canary(command)
    return {
        "os_system_in_extra_variables": (te_shapes.hostile_extra_state(command), "posix.system"),
        "os_system_as_the_recipe": (te_shapes._as_te_blob({"recipe": canary, "extra_fp8_variables": {}}),
                                    "posix.system"),
        "nested_storage_bytes_run_a_command": (_with_extra(_te_tensor_pickle_with_storage_bytes(_legacy_save(canary))),
                                               "posix.system"),
        "nested_storage_bytes_in_zip_format": (_with_extra(_te_tensor_pickle_with_storage_bytes(
            _zip_save(torch.ones(3).storage()))), "zip format"),
        "nested_storage_bytes_are_torchscript": (_with_extra(_te_tensor_pickle_with_storage_bytes(_torchscript())),
                                                 "torchscript format"),
        "nested_storage_larger_than_its_bytes": (_with_extra(_te_tensor_pickle_with_storage_bytes(
            _inflated_storage_bytes())), "more than the"),
        "nested_bytes_hold_a_dict_not_a_storage": (_with_extra(_te_tensor_pickle_with_storage_bytes(
            _legacy_save({"a": 1}))), "not a storage"),
        "callable_as_amax_compute_algo": (te_shapes.module_extra_state(te_shapes.DelayedScaling(
            amax_history_len=2, amax_compute_algo=torch.storage._load_from_bytes)), "function"),
        "class_as_a_value": (_with_extra(collections.OrderedDict), "type"),
        "custom_recipe_with_a_factory": (te_shapes._as_te_blob({"recipe": te_shapes.CustomRecipe(qfactory=len),
                                                                "extra_fp8_variables": {}}), "CustomRecipe"),
        "recipe_called_with_arguments": (_with_extra(_Call(te_shapes.DelayedScaling, 1)), "called with arguments"),
        "format_with_an_unknown_value": (_with_extra(_Call(te_shapes.Format, te_shapes._FormatHelper(1, 2))),
                                         "no member with value"),
        "tensor_with_requires_grad": (_with_extra(_Call(torch._utils._rebuild_tensor_v2, torch.ones(2).storage(), 0,
                                                        (2,), (1,), True, collections.OrderedDict())),
                                      "requires_grad"),
        "bytesio_runs_a_command": (io.BytesIO(_zip_save({"extra_fp8_variables": {"x": canary}})), "posix.system"),
        "bytesio_is_torchscript": (io.BytesIO(_torchscript()), "torchscript format"),
    }


HOSTILE = list(hostile("true"))


@pytest.mark.parametrize("attack", HOSTILE)
def test_hostile_extra_state_is_refused_and_runs_nothing(attack, tmp_path, audit):
    canary = tmp_path / "canary-touched-by-the-checkpoint"
    value, message = hostile(f"touch {canary}")[attack]
    key = "decoder.layers.1.self_attention.linear_proj._extra_state"
    with audit.watch():
        with pytest.raises(UnsafeCheckpointError) as info:
            check(value, key)
    text = str(info.value)
    assert message in text and FILE in text and repr(key) in text and "--datastates-allow-pickle" in text, text
    assert not audit.spawned() and not audit.changed()
    assert not canary.exists()


def test_a_persistent_id_in_the_outer_pickle_is_refused():
    class WithPersistentId(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if obj == "marker" else None

    buffer = io.BytesIO()
    WithPersistentId(buffer).dump({"extra_fp8_variables": {"x": "marker"}})
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        check(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))


def test_bytes_that_are_no_pickle_are_an_error_not_a_crash():
    with pytest.raises(CheckpointError, match="cannot be decoded") as info:
        check(torch.arange(40, dtype=torch.uint8))
    assert not isinstance(info.value, UnsafeCheckpointError)


def test_with_torch_forced_weights_only_the_nested_bytes_load_weights_only(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert check(te_shapes.module_extra_state(RECIPES["delayed_default"])) == 1
    canary = tmp_path / "canary"
    value, _ = hostile(f"touch {canary}")["nested_storage_bytes_run_a_command"]
    with pytest.raises(CheckpointError):
        check(value)
    assert not canary.exists()


def test_allow_pickle_skips_the_check_without_unpickling(tmp_path):
    canary = tmp_path / "canary"
    blob = te_shapes.hostile_extra_state(f"touch {canary}")
    assert tes.check_extra_state({"m._extra_state": blob}, allow_pickle=True, where=FILE) == 0
    assert not canary.exists()  # the check itself never unpickles; the module would, by the user's choice
    foreign = te_shapes.foreign_extra_state(fractions.Fraction(1, 3))
    with pytest.raises(UnsafeCheckpointError, match="fractions.Fraction"):
        check(foreign)
    assert tes.check_extra_state({"m._extra_state": foreign}, allow_pickle=True, where=FILE) == 0


def test_deepspeed_load_checks_the_module_extra_state(tmp_path, audit):
    """DeepSpeed hands the loaded module state to ``load_state_dict``: its extra state is checked first."""
    from megatron_ext.deepspeed_adapter import DeepSpeedDataStatesEngine

    canary = tmp_path / "canary"
    root = tmp_path / "ds"
    config = {"datastates_ckpt": {"host_cache_size": 0.01, "chunk_size_mb": 0.004}}
    engine = DeepSpeedDataStatesEngine(config, rank=0)
    trusting = None
    try:
        genuine = te_shapes.module_extra_state(RECIPES["delayed_tuned"])
        hostile_blob = te_shapes.hostile_extra_state(f"touch {canary}")
        for tag, blob in (("global_step1", genuine), ("global_step2", hostile_blob)):
            engine.save({"module": {"layer.weight": torch.ones(2), "layer._extra_state": blob}},
                        str(root / tag / "mp_rank_00_model_states.pt"))
            engine.wait(persist=True)
        engine.engine.wait_persisted()
        loaded = engine.load(str(root / "global_step1" / "mp_rank_00_model_states.pt"))
        assert equal(loaded["module"]["layer._extra_state"], genuine)
        with audit.watch():
            with pytest.raises(UnsafeCheckpointError, match="allow_pickle") as info:
                engine.load(str(root / "global_step2" / "mp_rank_00_model_states.pt"))
        assert str(root / "global_step2" / "mp_rank_00_model_states.pt") in str(info.value)
        assert not audit.spawned() and not canary.exists()
        with pytest.raises(Exception, match="allow_pickle must be true or false"):
            DeepSpeedDataStatesEngine({"datastates_ckpt": {"allow_pickle": "yes"}}, rank=0)
        trusting = DeepSpeedDataStatesEngine({"datastates_ckpt": {**config["datastates_ckpt"], "allow_pickle": True}},
                                             rank=0)
        state = trusting.load(str(root / "global_step2" / "mp_rank_00_model_states.pt"))
        assert state["module"]["layer._extra_state"].dtype == torch.uint8 and not canary.exists()
    finally:
        engine.shutdown()
        if trusting is not None:
            trusting.shutdown()


def test_extra_state_module_would_unpickle_what_reaches_it():
    """The TE-shaped module of the end-to-end test unpickles as TE does (so the check is what stops a payload)."""
    module = te_shapes.ExtraStateModule(te_shapes.no_fp8_extra_state())
    module.set_extra_state(te_shapes.foreign_extra_state(fractions.Fraction(2, 7)))
    assert module.loaded[0]["extra_fp8_variables"]["foreign"] == fractions.Fraction(2, 7)
    module.set_extra_state(te_shapes.no_fp8_extra_state())
    assert len(module.loaded) == 1


def test_engine_round_trip_keeps_the_blob_bit_for_bit(tmp_path):
    """What the adapters store for a uint8 extra state is the same bytes on load (the check sees TE's bytes)."""
    blob = te_shapes.module_extra_state(RECIPES["nvfp4"])
    with CheckpointEngine({"save_dir": str(tmp_path), "host_cache_size": 0.01, "chunk_size_mb": 0.004},
                          rank=0, world_size=1) as engine:
        engine.save({"m._extra_state": blob, "old._extra_state": te_shapes.te1_extra_state()}, "c1")
        engine.commit("c1")
        engine.wait_persisted()
        state = engine.load("c1", "rank00000")
    assert equal(state["m._extra_state"], blob)
    assert isinstance(state["old._extra_state"], io.BytesIO)
    assert tes.check_extra_state(state, allow_pickle=False, where=str(Path(tmp_path))) == 2


def test_the_flag_is_an_adapter_option():
    import argparse

    from megatron_ext.engine.errors import ConfigError
    from megatron_ext.megatron.args import MegatronAdapterOptions, add_datastates_args

    parser = add_datastates_args(argparse.ArgumentParser())
    assert not MegatronAdapterOptions.from_args(parser.parse_args(["--use-datastates"])).allow_pickle
    assert MegatronAdapterOptions.from_args(parser.parse_args(["--use-datastates", "--datastates-allow-pickle"])
                                            ).allow_pickle
    with pytest.raises(ConfigError, match="allow_pickle"):
        MegatronAdapterOptions(allow_pickle="yes")
