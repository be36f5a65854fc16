"""Loading never runs code the checkpoint chooses, through any tagged value of the sidecar.

Each attack is written into a genuine checkpoint's sidecar, the manifest re-sealed (an attacker
writes both), and the checkpoint loaded by an engine with the DeepSpeed adapter's allow-list (the
configuration the old module-prefix decoder let run a command). Every load must fail with a
``CheckpointError`` naming the sidecar, start no process (audit hook, and the command's canary
file never appears), delete nothing, and leave the previous checkpoint loadable.
"""

from __future__ import annotations

import base64
import collections
import enum
import fractions
import gc
import os
import pickle
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed.launcher.runner  # noqa: E402,F401  (a DeepSpeed module that imports subprocess)

from megatron_ext.deepspeed_adapter import DEEPSPEED_SAFE_CLASSES  # noqa: E402
from megatron_ext.engine import CheckpointEngine, CheckpointError, UnsafeCheckpointError, add_safe_classes  # noqa: E402
from megatron_ext.engine.format import codec  # noqa: E402

from helpers.hostile import C1, C2, SMALL, files_of, genuine_state, reseal, rewrite_sidecar  # noqa: E402
from helpers.procs import REPO  # noqa: E402


class Finalizer:
    """A class whose finalizer deletes a path: rebuilt with attacker fields it would delete anything."""

    def __del__(self):
        os.unlink(self.path)


class Hooked(enum.Enum):
    """An allowed enum whose ``_missing_`` hook runs code when called with an unknown value."""

    A = 1

    @classmethod
    def _missing_(cls, value):
        open(value, "w").close()
        return cls.A


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {Evil.target}",))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def attacks(spawned: str, canary: str) -> dict[str, tuple[object, str]]:
    """name -> (sidecar value, what the error must say)."""
    Evil.target = spawned
    popen_args = [["touch", spawned]]
    return {
        "nt_attribute_walk_to_popen": ({"$nt": ["deepspeed.launcher.runner", "subprocess.Popen", popen_args]},
                                       "class deepspeed.launcher.runner.subprocess.Popen, which this loader does not allow"),
        "nt_popen": ({"$nt": ["subprocess", "Popen", popen_args]}, "class subprocess.Popen"),
        "obj_popen": ({"$obj": ["subprocess", "Popen", {"args": ["touch", spawned]}]}, "class subprocess.Popen"),
        "obj_finalizer": ({"$obj": [__name__, "Finalizer", {"path": canary}]}, f"class {__name__}.Finalizer"),
        "enum_os_system": ({"$enum": ["os", "system", f"touch {spawned}"]}, "class os.system"),
        "enum_missing_hook": ({"$enum": [__name__, "Hooked", spawned]}, "has no member with value"),
        "pickle": ({"$pickle": _b64(pickle.dumps(Evil()))}, "allow_pickle=True"),
        "dtype_lazy_module": ({"$dtype": "_dynamo"}, "unknown torch dtype '_dynamo'"),
        "dtype_deprecated_attr": ({"$dtype": "has_cuda"}, "unknown torch dtype"),
        "numpy_object_array": ({"$nd": ["|O", [1], _b64(b"\0" * 8)]}, "numpy dtype '|O' is not allowed"),
        "numpy_structured": ({"$nd": ["|V8", [1], _b64(b"\0" * 8)]}, "numpy dtype '|V8' is not allowed"),
        "namespace_class_field": ({"$ns": {"__class__": {"$tuple": []}}}, "field name '__class__' is not allowed"),
        "obj_allowed_class_dunder_field": ({"$obj": ["deepspeed.runtime.fp16.loss_scaler", "LossScaler",
                                                     {"__dict__": {"cur_scale": 1.0}}]}, "field name '__dict__'"),
        "nt_of_a_plain_class": ({"$nt": ["deepspeed.runtime.fp16.loss_scaler", "LossScaler", [1]]},
                                "LossScaler is not a tuple"),
        "obj_of_an_enum": ({"$obj": ["deepspeed.runtime.zero.config", "ZeroStageEnum", {}]},
                           "objects are not stored field by field"),
        "unknown_tag": ({"$exec": "import os"}, "unknown tag $exec"),
        "unhashable_key": ({"$dict": [[{"k": 1}, 2]]}, "a dict cannot be a key"),
        "tensor_ref_not_in_manifest": ({"$t": "../iter_0000001/w"}, "does not list"),
    }


ATTACK_NAMES = list(attacks("x", "y"))


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_hostile_sidecar_value_is_refused_and_runs_nothing(genuine, tmp_path, audit, canary, attack):
    spawned = tmp_path / "spawned-by-the-checkpoint"
    payload, message = attacks(str(spawned), str(canary))[attack]
    add_safe_classes(Hooked)  # an allowed enum still may not run its hook
    rewrite_sidecar(genuine, C2, lambda state: state.update(step=payload))
    _, sidecar = files_of(genuine, C2)
    engine = CheckpointEngine({"save_dir": str(genuine), **SMALL, "safe_classes": list(DEEPSPEED_SAFE_CLASSES)},
                              read_only=True)
    try:
        with audit.watch():
            with pytest.raises(CheckpointError) as info:
                engine.load(C2, "rank00000")
            gc.collect()  # a rebuilt object with a finalizer would run it now
        assert message in str(info.value) and str(sidecar) in str(info.value), str(info.value)
        audit.assert_confined(genuine, tmp_path)
        assert not spawned.exists() and canary.read_text() == "alive"
        previous = engine.load(C1, "rank00000")
        assert torch.equal(previous["w"], genuine_state(1)["w"]) and previous["step"] == 1
    finally:
        engine.shutdown()


def test_pickle_is_refused_with_its_own_error(genuine, tmp_path, audit):
    """The refusal names what the pickle would call (read from its opcodes, never run) and where it is."""
    spawned = tmp_path / "spawned"
    payload, _ = attacks(str(spawned), "")["pickle"]
    rewrite_sidecar(genuine, C2, lambda state: state.update(step=payload))
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with audit.watch():
            with pytest.raises(UnsafeCheckpointError, match=rf"holds a pickled object of class {os.name}\.system "
                                                            r"\(at /step\)") as info:
                engine.load(C2, "rank00000")
        assert not audit.spawned()
    assert info.value.pickled and info.value.classes == (f"{os.name}.system",) and info.value.place == "/step"
    assert not spawned.exists()


def test_the_names_in_a_pickle_are_read_without_running_it():
    """Every protocol; memoised STACK_GLOBAL strings; a damaged pickle names what it could read, no error."""
    value = {"a": [fractions.Fraction(1, 3), collections.OrderedDict(), fractions.Fraction(1, 2)]}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert codec.pickle_globals(pickle.dumps(value, protocol=protocol)) == ["fractions.Fraction",
                                                                                 "collections.OrderedDict"]
    assert codec.pickle_globals(pickle.dumps(value)[:40]) == []
    assert codec.pickle_globals(b"not a pickle") == []


def test_a_finalizer_class_cannot_be_allowed():
    with pytest.raises(TypeError, match="has a finalizer"):
        add_safe_classes(Finalizer)
    with pytest.raises(ValueError, match="has a finalizer"):
        codec.resolve_class_names([f"{__name__}.Finalizer"])


@pytest.mark.parametrize("name", ["deepspeed.launcher.runner.subprocess.Popen", "os.path.os.system",
                                  "collections.abc.Mapping.register", "subprocess.Popen.__init__"])
def test_allow_list_names_must_be_the_class_own_name(name):
    with pytest.raises(ValueError, match="is not a class defined under that exact name"):
        codec.resolve_class_names([name])


def test_the_shipped_deepspeed_list_resolves_to_exact_classes():
    classes = codec.resolve_class_names(DEEPSPEED_SAFE_CLASSES)
    assert sorted(codec.class_name(c) for c in classes.values()) == sorted(DEEPSPEED_SAFE_CLASSES)


def test_decoding_imports_nothing(tmp_path):
    """In a fresh interpreter: a sidecar naming lazy torch modules and unimported classes imports nothing."""
    code = """
import sys, torch
from megatron_ext.engine.format import codec
lazy = sorted(n for n in torch._lazy_modules if f"torch.{n}" not in sys.modules)
before = set(sys.modules)
for value in [{"$dtype": n} for n in lazy] + [{"$enum": ["json.tool", "X", 1]}, {"$obj": ["http.server", "HTTPServer", {}]},
              {"$nt": ["xml.dom.minidom", "Node", []]}]:
    try:
        codec.decode(value, lambda name: None)
    except Exception as exc:
        assert type(exc).__name__ in ("CheckpointError", "UnsafeCheckpointError"), exc
print(len(lazy), sorted(set(sys.modules) - before))
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    count, imported = out.stdout.split(" ", 1)
    assert int(count) > 0 and imported.strip() == "[]", out.stdout


def test_deep_nesting_is_a_clear_error(genuine):
    _, sidecar = files_of(genuine, C2)
    text = '{"format": "megatron_ext.state", "state": ' + "[" * 100_000 + "1" + "]" * 100_000 + "}"
    sidecar.write_text(text)
    reseal(genuine, C2)
    with CheckpointEngine({"save_dir": str(genuine), **SMALL}, read_only=True) as engine:
        with pytest.raises(CheckpointError, match=f"{sidecar}: .*nested too deeply"):
            engine.load(C2, "rank00000")
