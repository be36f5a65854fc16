"""Property: ``verify`` and ``load`` agree on every mutation of a genuine checkpoint.

Hypothesis mutates the bytes of the tensor file, the sidecar and the manifest, and the JSON of the
manifest and the sidecar (any value anywhere replaced, removed or added, tag-shaped values
included), optionally re-sealing the manifest to the mutated files as an attacker would. For every
mutant, either ``verify`` finds no problem, ``load`` returns the state bit for bit (the original
one when nothing was re-sealed) and the ``safetensors`` library loads the same tensor bytes; or
``verify`` reports a problem and ``load`` raises ``CheckpointError``. Never anything else.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ext.engine import CheckpointEngine, CheckpointError
from megatron_ext.engine.format import codec
from megatron_ext.engine.read.verify import verify_checkpoint

from helpers.hostile import C2, SMALL, files_of, genuine_state, manifest_path, report_path, reseal

# Derandomized: CI runs the same examples every time (a failure is reproducible from the log).
PROPERTY = settings(max_examples=250, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TAGS = ["$t", "$f", "$dict", "$odict", "$tuple", "$ns", "$bytes", "$bytesio", "$dtype", "$size", "$nd", "$npscalar",
        "$set", "$frozenset", "$enum", "$nt", "$obj", "$pickle"]
SPECIAL = ["../secret", "/etc/passwd", f"{C2}/../x", "iter_0000001/rank00000.0123456789ab.safetensors", "F32", "I64",
           "BF16", "F99", "w", "b", "h", "__metadata__", "nan", "bfloat16", "subprocess", "Popen", "gAR9lC4=",
           "megatron_ext.datastates", "0123456789ab"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, 1, -1, 8, 4096, 2 ** 63])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.sampled_from(SPECIAL),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | st.sampled_from(TAGS), inner,
                                                                max_size=2),
    max_leaves=6)


def _mutate_json(data: st.DataObject, doc):
    """Replace, remove or add one value somewhere in ``doc`` (returns the new document)."""
    path: list = []
    node = doc
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans(), label="descend"):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append(key)
        node = node[key]
    op = data.draw(st.sampled_from(["replace", "remove", "add"]), label="op")
    if not path:
        return data.draw(JSON_VALUES, label="document")
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "remove":
        del parent[last]
    elif op == "add" and isinstance(parent, dict):
        parent[data.draw(st.text(max_size=6) | st.sampled_from(TAGS), label="new key")] = data.draw(JSON_VALUES)
    else:
        parent[last] = data.draw(JSON_VALUES, label="value")
    return doc


@pytest.fixture(scope="module")
def reader():
    engine = CheckpointEngine({**SMALL}, read_only=True)
    yield engine
    engine.shutdown()


def _check_agreement(root: Path, resealed: bool, engine: CheckpointEngine) -> None:
    problems = verify_checkpoint(str(root), C2, deep=True)
    try:
        loaded = engine.load(C2, "rank00000", root=str(root))
    except CheckpointError as exc:
        assert problems, f"load refused what verify passes: {exc}"
        return
    assert not problems, f"load accepted what verify refuses: {problems[0]}"
    tensor_file, sidecar = files_of(root, C2)
    library = safetensors.torch.load_file(str(tensor_file))  # the library loads what verify passes
    # The same state from the library's tensors and the sidecar as it is: bit for bit what load returned.
    oracle = codec.decode(json.loads(sidecar.read_bytes())["state"], lambda name: library[name])
    _assert_bitwise(loaded, oracle)
    if not resealed:
        _assert_bitwise(loaded, genuine_state(2))


def _assert_bitwise(got, want, where="state") -> None:
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _assert_bitwise(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_bitwise(g, w, f"{where}/{i}")
    elif isinstance(want, float) and want != want:
        assert got != got, where
    else:
        assert got == want, (where, got, want)


def _fresh(pristine: Path) -> Path:
    root = Path(tempfile.mkdtemp(prefix="prop-")) / "ckpt"
    shutil.copytree(pristine, root, symlinks=True)
    return root


@PROPERTY
@given(data=st.data())
def test_byte_mutations(pristine, reader, data):
    root = _fresh(pristine)
    try:
        target = data.draw(st.sampled_from(["tensor", "sidecar", "manifest", "report"]), label="file")
        path = {"tensor": files_of(root, C2)[0], "sidecar": files_of(root, C2)[1], "manifest": manifest_path(root, C2),
                "report": report_path(root, C2)}[target]
        raw = bytearray(path.read_bytes())
        op = data.draw(st.sampled_from(["set", "truncate", "append"]), label="op")
        if op == "set":
            at = data.draw(st.integers(0, len(raw) - 1), label="offset")
            raw[at] = data.draw(st.integers(0, 255), label="byte")
        elif op == "truncate":
            del raw[data.draw(st.integers(0, len(raw) - 1), label="new length"):]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=16), label="tail")
        path.write_bytes(bytes(raw))
        resealed = target != "manifest" and data.draw(st.booleans(), label="reseal")
        if resealed:
            try:
                reseal(root, C2)
            except (ValueError, KeyError, TypeError):  # the manifest is not JSON any more: nothing to re-seal
                resealed = False
        _check_agreement(root, resealed, reader)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


@PROPERTY
@given(data=st.data())
def test_json_mutations(pristine, reader, data):
    root = _fresh(pristine)
    try:
        target = data.draw(st.sampled_from(["manifest", "sidecar", "report"]), label="document")
        path = {"manifest": manifest_path(root, C2), "sidecar": files_of(root, C2)[1],
                "report": report_path(root, C2)}[target]
        doc = _mutate_json(data, json.loads(path.read_bytes()))
        path.write_text(json.dumps(doc))
        resealed = data.draw(st.booleans(), label="reseal")
        if resealed:
            try:
                reseal(root, C2)
            except (ValueError, KeyError, TypeError, AttributeError, OSError):  # too broken to re-seal
                resealed = False
        _check_agreement(root, resealed, reader)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
