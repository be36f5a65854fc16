"""Transformer Engine's pickled extra state, checked before any module unpickles it.

With fp8, every Transformer Engine module keeps its fp8 metadata in ``_extra_state``: TE 2.9-2.11
(``transformer_engine/pytorch/module/base.py``, ``TransformerEngineBaseModule.get_extra_state``;
``pytorch/ops/op.py`` for the fusible ops) store ``torch.frombuffer(bytearray(pickle.dumps(state)),
dtype=torch.uint8)``, an empty uint8 tensor without fp8, and TE 1.x a ``BytesIO`` written by
``torch.save``. Loading, ``set_extra_state`` runs ``pickle.loads`` on those bytes (and
Megatron-LM's ``TEGroupedLinear._decode_extra_state`` at the pin does the same in its load
pre-hook): whatever the checkpoint's bytes name, Python imports and calls. A checkpoint is
untrusted input (docs/RELIABILITY.md, "Threat model"), so before model state reaches
``load_state_dict`` every non-empty ``_extra_state`` value is decoded here with a restricted
unpickler, and refused with an ``UnsafeCheckpointError`` (a ``CheckpointError``) naming the file
and the module when it holds anything TE does not write. ``--datastates-allow-pickle`` skips the
check for a checkpoint the user trusts.

What TE writes, and so all that is allowed (read from TE 2.9, 2.10 and 2.11, identical in this):

* a dict with ``recipe``, for delayed scaling ``scale_fwd``, ``amax_history_fwd``, ``scale_bwd``,
  ``amax_history_bwd`` (CPU float32 tensors), and ``extra_fp8_variables`` (a dict of bools,
  numbers, strings, tuples and lists; recipe objects may sit in those lists); the fusible ops nest
  the same per ``forward``/``backward``;
* the recipe: an object of one of the exact classes ``transformer_engine.common.recipe``
  ``.DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``, ``Float8BlockScaling``,
  ``NVFP4BlockScaling``, and their fields' ``MMParams``, ``QParams``, ``Format`` (an enum, pickled
  as ``Format(<value>)``) and ``_FormatHelper`` (a named tuple). They are pydantic dataclasses,
  pickled as ``NEWOBJ`` of the class with no arguments then ``BUILD`` with the field dict.
  ``CustomRecipe`` is not allowed: its ``qfactory`` is a callable, which only a pickle of code can
  carry;
* a tensor pickles as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
  requires_grad, OrderedDict())`` whose storage is ``torch.storage._load_from_bytes(<bytes>)``:
  a nested ``torch.save`` of the storage (the legacy format), which torch loads with
  ``torch.load(weights_only=False)``.

How the check works. The outer pickle is run by a subclass of the C ``pickle.Unpickler`` (the
same parser ``pickle.loads`` uses) whose ``find_class`` answers only the names above, each with a
stand-in of this module, never the real callable: ``_rebuild_tensor_v2`` checks its arguments'
types before building the tensor, recipe classes and enums become inert records
(``TERecord``, ``TEFormat``, ``TEFormatHelper``) that accept exactly the opcodes TE's pickles
use, and ``_load_from_bytes`` loads the nested bytes with torch's own loader
(``torch.load(..., pickle_module=<restricted>)``, again the C parser), where only storage types
resolve (torch's loader answers those itself) and every storage must fit in the nested bytes
(a pickle cannot make the check allocate more than the checkpoint holds). The nested bytes must be
in the legacy format TE writes (a ``BytesIO``: torch's zip or legacy format): a TorchScript archive
(which ``torch.load`` would hand to ``torch.jit.load``) and the old tar format (which it would
extract to a temporary directory) are refused before torch sees them. Persistent ids outside
torch's loader, extension codes and every other global are refused. The decoded value is then walked: only
``None``, bools, numbers, strings, bytes, plain CPU tensors without hooks or gradients, the
records above and the built-in containers of them may remain (no function or class object, which
TE could later call, e.g. as ``amax_compute_algo``). When ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` is
set, torch itself loads every nested storage with ``weights_only=True``, and so does the check.

What reaches ``load_state_dict`` is the original value, unchanged: TE's ``pickle.loads`` then
parses the same bytes with the same C parser, resolves the same names (now to the real
functions and classes, called with the arguments the check accepted) and builds the values the
check built and inspected, and its nested ``torch.load`` parses the same nested bytes as the
check's did. (Handing TE a re-pickled copy instead would need TE's classes to re-pickle recipes,
which are absent wherever TE is not imported.) Values other than tensors and
``BytesIO`` (e.g. ``None``, or objects ModelOpt keeps) came through the sidecar's safe decoder
already and are not pickles; they are left alone.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import pickle
import re
import sys
import tarfile
import types
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch

from megatron_ext.engine import CheckpointError, UnsafeCheckpointError

log = logging.getLogger("megatron_ext.megatron")

#: A module's extra state in a state dict: ``<prefix>_extra_state``, and Megatron-LM's
#: ``TEGroupedLinear`` (sharded per gemm) adds ``<prefix>_extra_state1`` .. ``<prefix>_extra_state<n-1>``.
EXTRA_STATE_KEY = re.compile(r"(?:^|\.)_extra_state[0-9]*$")

RECIPE_MODULE = "transformer_engine.common.recipe"
#: The recipe classes TE 2.9-2.11 pickle as objects (``common/recipe/__init__.py``).
RECIPE_CLASSES = ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
                  "NVFP4BlockScaling", "MMParams", "QParams")
#: ``Format``'s members and their values (``_FormatHelper(max_fwd, max_bwd)``), TE 2.9-2.11.
FORMAT_MEMBERS = {"E2M1": (6, 6), "E4M3": (448, 448), "E5M2": (57344, 57344), "HYBRID": (448, 57344)}

MEGATRON_OPT_IN = "--datastates-allow-pickle"


class Refused(Exception):
    """The pickle asks for something TE does not write (internal; reported as ``UnsafeCheckpointError``)."""


# ---------------------------------------------------------------------------- inert stand-ins
class TERecord:
    """A TE recipe object as the check decodes it: its TE class name and its fields, nothing callable.

    The pickle creates it with ``NEWOBJ`` (no arguments) or a call without arguments, then
    ``BUILD`` hands it the field dict, exactly as TE's dataclasses are pickled.
    """

    te_class: ClassVar[str] = ""
    __slots__ = ("fields",)

    def __new__(cls, *args: Any, **kwargs: Any) -> "TERecord":
        if args or kwargs:
            raise Refused(f"{RECIPE_MODULE}.{cls.te_class} is called with arguments (TE pickles it field by field)")
        record = object.__new__(cls)
        record.fields = {}
        return record

    def __setstate__(self, state: Any) -> None:
        if type(state) is not dict or not all(type(key) is str and not key.startswith("__") for key in state):
            raise Refused(f"{RECIPE_MODULE}.{self.te_class} is given a state that is not a dict of its fields")
        self.fields.update(state)

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.fields == self.fields

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TERecord({self.te_class}, {self.fields!r})"


class TEFormatHelper(tuple):
    """TE's ``_FormatHelper(max_fwd, max_bwd)`` named tuple, as two numbers."""

    __slots__ = ()

    def __new__(cls, *values: Any) -> "TEFormatHelper":
        if len(values) != 2 or not all(type(v) in (int, float) for v in values):
            raise Refused(f"{RECIPE_MODULE}._FormatHelper needs two numbers, got {values!r}")
        return tuple.__new__(cls, values)


class TEFormat:
    """A member of TE's ``Format`` enum, found by value as ``Format(value)`` finds it (never ``_missing_``)."""

    __slots__ = ("name",)
    members: ClassVar[dict[str, "TEFormat"]] = {}

    def __new__(cls, value: Any) -> "TEFormat":
        if not isinstance(value, tuple) or not all(type(v) in (int, float) for v in value):
            raise Refused(f"{RECIPE_MODULE}.Format is called with {type(value).__name__}, not a _FormatHelper")
        for name, member_value in FORMAT_MEMBERS.items():
            if tuple(value) == member_value:
                return cls.members[name]
        raise Refused(f"{RECIPE_MODULE}.Format has no member with value {tuple(value)!r}")

    def __repr__(self) -> str:
        return f"TEFormat.{self.name}"


for _name in FORMAT_MEMBERS:
    _member = object.__new__(TEFormat)
    _member.name = _name
    TEFormat.members[_name] = _member

_RECORDS = {name: type(name, (TERecord,), {"te_class": name, "__slots__": (), "__module__": __name__})
            for name in RECIPE_CLASSES}


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                    backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` for a plain CPU tensor, its arguments checked first."""
    if type(storage) is not torch.storage.TypedStorage:
        raise Refused(f"a tensor is rebuilt from {type(storage).__name__}, not a storage")
    shape_ok = all(type(t) is tuple and all(type(n) is int and n >= 0 for n in t) for t in (size, stride))
    if type(storage_offset) is not int or storage_offset < 0 or not shape_ok or len(size) != len(stride):
        raise Refused("a tensor is rebuilt with a malformed offset, size or stride")
    if type(requires_grad) is not bool or requires_grad:
        raise Refused("a tensor is rebuilt with requires_grad (TE's extra state holds plain CPU copies)")
    if type(backward_hooks) not in (dict, collections.OrderedDict) or backward_hooks:
        raise Refused("a tensor is rebuilt with backward hooks")
    if metadata is not None and (type(metadata) is not dict or metadata):
        raise Refused("a tensor is rebuilt with metadata")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, False, collections.OrderedDict())


def _load_storage_from_bytes(data: Any) -> torch.storage.TypedStorage:
    """``torch.storage._load_from_bytes``: a nested ``torch.save`` that must hold one storage."""
    if type(data) is not bytes:
        raise Refused(f"a storage is loaded from {type(data).__name__}, not bytes")
    storage = _torch_load(data, {}, ("legacy",))
    if type(storage) is not torch.storage.TypedStorage:
        raise Refused(f"nested torch.save bytes hold {type(storage).__name__}, not a storage")
    return storage


#: The outer pickle's globals: TE's exact names, each answered by a stand-in (never the real object).
_OUTER_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage_from_bytes,
    # megatron-core >= 0.19 rebinds torch.storage._load_from_bytes to this at import
    # (megatron/core/__init__.py), so pickles made in its processes name it instead.
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _load_storage_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    (RECIPE_MODULE, "Format"): TEFormat,
    (RECIPE_MODULE, "_FormatHelper"): TEFormatHelper,
    **{(RECIPE_MODULE, name): record for name, record in _RECORDS.items()},
}


# ---------------------------------------------------------------------------- the restricted unpicklers
class _Budget:
    """Bytes that storages named by one pickle may still take: never more than the bytes it came in."""

    def __init__(self, nbytes: int):
        self.left = nbytes

    def take(self, pid: Any) -> None:
        if type(pid) is not tuple or len(pid) not in (5, 6):
            raise Refused("a persistent id that is not a storage record")
        typename = pid[0].decode("ascii", "replace") if isinstance(pid[0], bytes) else pid[0]
        numel = pid[4]
        dtype = getattr(pid[1], "dtype", None)
        if typename != "storage" or type(numel) is not int or numel < 0 or not isinstance(dtype, torch.dtype):
            raise Refused(f"a persistent id of type {typename!r} (only storages are allowed)")
        nbytes = numel * torch._utils._element_size(dtype)
        if nbytes > self.left:
            raise Refused(f"a storage of {nbytes} bytes, more than the {self.left} bytes that hold it")
        self.left -= nbytes


def _restricted_unpickler(allowed: Mapping[tuple[str, str], Any], budget: _Budget | None) -> type:
    class Unpickler(pickle.Unpickler):
        def __init__(self, file: Any, **kwargs: Any):
            super().__init__(file, **kwargs)
            self.persistent_load = self._refuse_persistent_id  # torch's own loader sets its own

        def find_class(self, module: str, name: str) -> Any:
            target = allowed.get((module, name))
            if target is None:
                raise Refused(f"the pickle asks for {module}.{name}, which TE's extra state never holds")
            return target

        def _refuse_persistent_id(self, pid: Any) -> Any:
            raise Refused("the pickle holds a persistent id (TE's pickles have none)")

        def load(self) -> Any:
            # torch's own loader sets ``persistent_load`` (its storages): each one is sized against
            # the bytes that hold it before torch allocates it.
            torch_persistent = self.persistent_load
            if torch_persistent != self._refuse_persistent_id:
                if budget is None:
                    raise Refused("a persistent id outside torch's loader")

                def sized(pid: Any) -> Any:
                    budget.take(pid)
                    return torch_persistent(pid)

                self.persistent_load = sized
            return super().load()

    return Unpickler


def _weights_only_forced() -> bool:
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def _container(data: bytes) -> str:
    """Which of torch.load's paths ``data`` takes: ``zip``, ``torchscript`` (a zip it hands to
    ``torch.jit.load``), ``tar`` (the oldest format, which it extracts into a temporary directory)
    or ``legacy`` (pickles back to back, what ``torch.save(..., _use_new_zipfile_serialization=False)``
    writes). Decided as torch decides it, without extracting anything."""
    if data[:4] == b"PK\x03\x04":  # torch.serialization._is_zipfile: the first bytes only
        try:
            with torch.serialization._open_zipfile_reader(io.BytesIO(data)) as archive:
                return "torchscript" if "constants.pkl" in archive.get_all_records() else "zip"
        except Exception:
            return "torchscript"  # unreadable as torch reads it: refused with the dangerous kind
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:"):
            return "tar"
    except tarfile.TarError:
        return "legacy"


def _torch_load(data: bytes, allowed: Mapping[tuple[str, str], Any], containers: tuple[str, ...]) -> Any:
    """``torch.load`` of ``data`` by torch's own loader, its pickles parsed by the restricted unpickler."""
    kind = _container(data)
    if kind not in containers:
        raise Refused(f"torch.save bytes in the {kind} format (TE writes {' or '.join(containers)})")
    if _weights_only_forced():  # then torch loads TE's nested storages weights-only too; do the same
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    unpickler = _restricted_unpickler(allowed, _Budget(len(data)))
    module = types.SimpleNamespace(__name__="megatron_ext.restricted_pickle", Unpickler=unpickler,
                                   load=lambda f, **kwargs: unpickler(f, **kwargs).load())
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=module)


def _loads(data: bytes) -> Any:
    """``pickle.loads(data)`` as TE runs it, by the restricted unpickler (same defaults)."""
    return _restricted_unpickler(_OUTER_GLOBALS, None)(io.BytesIO(data)).load()


_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, TEFormat)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple, set, frozenset, TEFormatHelper)


def _inspect(value: Any) -> None:
    """Every value the pickle built is inert: plain values, plain CPU tensors, records, containers of them."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) in _PLAIN:
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if type(item) is torch.Tensor:
            if item.device.type != "cpu" or item.requires_grad or item._backward_hooks or vars(item):
                raise Refused("a tensor with hooks, gradients or attributes")
        elif isinstance(item, TERecord) and type(item) in _RECORDS.values():
            stack.extend(item.fields.values())
        elif type(item) in _CONTAINERS:
            if type(item) is collections.OrderedDict and vars(item):
                raise Refused("an OrderedDict with attributes")
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
        else:
            raise Refused(f"a value of type {type(item).__module__}.{type(item).__qualname__} "
                          "(only numbers, strings, plain tensors, TE recipes and containers of them)")


def _materialize(value: Any) -> Any:
    """Records turned into TE's own classes when TE is imported (for callers that compare values)."""
    recipe = sys.modules.get(RECIPE_MODULE)
    if recipe is None:
        return value
    done: dict[int, Any] = {}

    def real(item: Any) -> Any:
        if id(item) in done:
            return done[id(item)]
        if isinstance(item, TEFormat):
            out = getattr(recipe, "Format").__members__[item.name]
        elif isinstance(item, TEFormatHelper):
            out = tuple.__new__(getattr(recipe, "_FormatHelper"), item)
        elif isinstance(item, TERecord):
            cls = getattr(recipe, item.te_class)
            out = cls.__new__(cls)
            done[id(item)] = out
            out.__dict__.update({k: real(v) for k, v in item.fields.items()})
        elif type(item) in (dict, collections.OrderedDict):
            out = type(item)()
            done[id(item)] = out
            out.update((real(k), real(v)) for k, v in item.items())
        elif type(item) in (list, tuple, set, frozenset):
            out = type(item)(real(v) for v in item)
        else:
            out = item
        done[id(item)] = out
        return out

    return real(value)


# ---------------------------------------------------------------------------- the checks
def extra_state_bytes(value: Any) -> bytes | None:
    """The bytes TE would unpickle from an ``_extra_state`` value; None when it would unpickle nothing."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None
        flat = value.detach().cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.uint8 else flat.numpy().tobytes()
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    return None


def decode_extra_state(value: Any, *, materialize: bool = True) -> Any:
    """Decode one ``_extra_state`` value as TE would, refusing anything TE does not write.

    A uint8 tensor is TE 2.x's pickle, a ``BytesIO`` TE 1.x's ``torch.save``; an empty tensor and
    ``None`` decode to None. Raises ``Refused`` for a pickle that asks for more, and other
    exceptions for bytes that are no pickle at all. With ``materialize`` and TE imported, recipes
    come back as TE's own objects, else as ``TERecord``/``TEFormat`` records.
    """
    data = extra_state_bytes(value)
    if data is None:
        return None
    decoded = _torch_load(data, _OUTER_GLOBALS, ("zip", "legacy")) if isinstance(value, io.BytesIO) else _loads(data)
    _inspect(decoded)
    return _materialize(decoded) if materialize else decoded


def extra_state_items(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every extra-state entry of a (possibly nested) state dict, keys joined with dots."""
    if not isinstance(state, Mapping):
        return
    for key, value in state.items():
        path = f"{prefix}{key}" if isinstance(key, str) else f"{prefix}{key!r}"
        if isinstance(value, Mapping):
            yield from extra_state_items(value, path + ".")
        elif isinstance(key, str) and EXTRA_STATE_KEY.search(key):
            yield path, value


def check_extra_state(state: Any, *, allow_pickle: bool, where: Callable[[str, Any], str] | str,
                      opt_in: str = MEGATRON_OPT_IN) -> int:
    """Check every non-empty extra state of ``state`` before modules unpickle it; returns how many were checked.

    ``where(key, value)`` (or a fixed string) names the file the value came from. A refusal is an
    ``UnsafeCheckpointError`` naming the file and the module's state dict key; bytes that are no
    pickle a ``CheckpointError``. ``allow_pickle`` (the user's ``opt_in``) checks nothing.
    """
    entries = [(key, value) for key, value in extra_state_items(state) if extra_state_bytes(value) is not None]
    if allow_pickle:
        if entries:
            log.warning("[datastates] %s: %d Transformer Engine extra state(s) go to their modules unchecked, "
                        "which unpickle them", opt_in, len(entries))
        return 0
    hint = f"if you trust this checkpoint, load it with {opt_in}"
    for key, value in entries:
        source = where(key, value) if callable(where) else where
        try:
            decode_extra_state(value, materialize=False)
        except Refused as exc:
            raise UnsafeCheckpointError(
                f"{source}: the extra state of module {key!r} is a pickle that Transformer Engine would unpickle, "
                f"and it holds more than TE's fp8 metadata: {exc}; refused, nothing was run ({hint})") from None
        except Exception as exc:  # not a pickle at all: TE would fail on it too
            raise CheckpointError(f"{source}: the extra state of module {key!r} cannot be decoded as Transformer "
                                  f"Engine's fp8 metadata ({type(exc).__name__}: {exc}); {hint}") from None
    return len(entries)
