"""Safe encoding of the non-tensor part of a state (the sidecar).

A checkpoint is untrusted input, so decoding must never run code the file chooses. The nested
state becomes tagged JSON: containers and plain values map directly, tensors become references
into the safetensors file, and a short list of well-known types (numpy arrays, torch dtypes,
argparse namespaces, ...) get explicit tags. Like ``torch.load(weights_only=True)``, any other
class is stored only if it is on an allow-list of exact classes (``add_safe_classes``, or the
``safe_classes`` config key): enum members by value, named tuples and plain objects field by
field. Anything else is refused at save time, or, with ``pickle_fallback``, stored as a pickle
blob that ``decode`` unpickles only when asked to (``allow_pickle=True``).

Decoding looks classes up by their exact ``(module, qualname)`` in the allow-list: it never
imports, never walks attributes, never calls a constructor, ``__setstate__`` or ``_missing_``.
Named tuples are rebuilt with ``tuple.__new__``, objects with ``__new__`` plus their stored
fields. Every problem is a ``CheckpointError`` that names the file and the place in it.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import enum
import importlib
import io
import json
import math
import operator
import pickle
import pickletools
import re
import secrets
import threading
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from ..errors import CheckpointError, EncodeError, UnsafeCheckpointError
from .tensor_file import shape_elements

TAG = "$"  # dicts whose only key starts with TAG are tagged values
#: The types a sidecar holds as they are (a subclass, such as an ``IntEnum``, is not one of them).
_AS_IS = frozenset((type(None), bool, str, int))

#: Every ``torch.dtype`` by its short name, fixed at import: decoding never asks ``torch`` for an
#: attribute (its lazy ``__getattr__`` can import submodules).
_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
#: numpy dtypes a sidecar may hold: numbers, booleans and fixed-width strings (never objects).
_NP_KINDS = "biufcSU"
_NP_DTYPE = re.compile(r"[<>|=]?[biufcSU][0-9]{1,6}")


# ------------------------------------------------------------------------------------ allow-list
ClassKey = tuple[str, str]  # (module, qualname), exactly as the class reports them

_registry: dict[ClassKey, type] = {}
_registry_lock = threading.Lock()


def class_key(cls: type) -> ClassKey:
    return cls.__module__, cls.__qualname__


def class_name(cls: type) -> str:
    return "{}.{}".format(*class_key(cls))


def _check_safe_class(cls: Any) -> type:
    """A class may be allowed if rebuilding it from fields cannot run code of its own later."""
    if not isinstance(cls, type):
        raise TypeError(f"{cls!r} is not a class")
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"{class_name(cls)} is defined inside a function; only module-level classes can be allowed")
    if any("__del__" in vars(base) for base in cls.__mro__[:-1]):
        raise TypeError(f"{class_name(cls)} has a finalizer (__del__); an object rebuilt from a checkpoint's "
                        "fields would run it, so it cannot be allowed")
    if not issubclass(cls, enum.Enum) and issubclass(cls, tuple) and not hasattr(cls, "_fields"):
        raise TypeError(f"{class_name(cls)} is a tuple subclass but not a named tuple")
    return cls


def add_safe_classes(*classes: type) -> None:
    """Allow these exact classes in every engine of this process (like ``torch.serialization.add_safe_globals``)."""
    checked = [_check_safe_class(cls) for cls in classes]
    with _registry_lock:
        for cls in checked:
            _registry[class_key(cls)] = cls


def safe_classes() -> list[str]:
    """Names of the classes allowed process-wide."""
    with _registry_lock:
        return sorted("{}.{}".format(*key) for key in _registry)


def resolve_class_names(names: Iterable[str]) -> dict[ClassKey, type]:
    """Classes named ``"module.QualName"`` in a configuration (trusted input: this may import).

    The name must be the class's own ``__module__`` and ``__qualname__``: a class reached through
    another module's attribute (``pkg.mod.subprocess.Popen``) is refused.
    """
    found: dict[ClassKey, type] = {}
    for name in names:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", name):
            raise ValueError(f"safe class {name!r} is not a dotted name such as 'package.module.ClassName'")
        parts = name.split(".")
        cls = None
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            module_name, qualname = ".".join(parts[:cut]), ".".join(parts[cut:])
            try:
                obj: Any = importlib.import_module(module_name)
            except ImportError:
                continue
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, type) and class_key(obj) == (module_name, qualname):
                cls = obj
            break
        if cls is None:
            raise ValueError(f"safe class {name!r} is not a class defined under that exact name")
        try:
            _check_safe_class(cls)
        except TypeError as exc:
            raise ValueError(f"safe class {name!r}: {exc}") from None
        found[class_key(cls)] = cls
    return found


def allowed_classes(extra: Mapping[ClassKey, type] | None = None) -> dict[ClassKey, type]:
    """The process-wide allow-list plus ``extra`` (an engine's configured classes)."""
    with _registry_lock:
        allowed = dict(_registry)
    allowed.update(extra or {})
    return allowed


# ------------------------------------------------------------------------------------ encoding
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Frozen:
    """A value its owner will not change again (nor anything inside it): saved as the value itself
    (the file does not tell them apart), and a ``save(..., reuse=True)`` that meets the same
    ``Frozen`` object again, at the same place in the state, reuses its encoding, as JSON text,
    instead of walking and serializing it (``Encoder(memo=)``, ``Encoder.dumps``). Tensors in it
    stay the same objects, whose values are read at each save as always (their memory is checked
    by the file's plan, ``file_plan.ReusablePlan``). Changing the value after wrapping it is the
    owner's error: later saves would hold the old one."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class Encoder:
    """Walks a nested state once: collects tensors (in order) and builds the JSON skeleton."""

    def __init__(self, pickle_fallback: bool = False, classes: Mapping[ClassKey, type] | None = None,
                 prepare: bool = True, memo: Mapping[int, tuple[Frozen, Any]] | None = None):
        """``prepare=False``: ``tensors`` holds each tensor as given, unchecked and not detached; the
        caller runs ``prepare_tensor`` on those it keeps (``file_plan``: not on a reused plan's).
        ``memo``: the encodings of ``Frozen`` values an earlier walk made (its ``frozen``)."""
        self.pickle_fallback = pickle_fallback
        self.classes = allowed_classes(classes)
        self.prepare = prepare
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._names: set[str] = set()
        self._memo = memo or {}
        # id -> (the Frozen, its JSON text, its path, its tensors as named here), met in this walk
        self.frozen: dict[int, tuple[Frozen, str, str, tuple]] = {}
        self._splices: dict[str, str] = {}  # a placeholder's JSON -> the reused text it stands for
        self._nonce = ""  # set at the first reuse: no string of the state can be mistaken for a placeholder

    def encode(self, value: Any, path: str = "") -> Any:
        cls = type(value)
        if cls in _AS_IS:
            return value
        if cls is Frozen:
            return self._frozen(value, path)
        if isinstance(value, torch.Tensor):
            return {TAG + "t": self._add_tensor(path, value)}
        if cls is float:
            return value if math.isfinite(value) else {TAG + "f": repr(value)}  # nan, inf, -inf
        # Plain keys and plain lists take no call per member: a Megatron rank's state has thousands of
        # them (shard metadata) and this runs on the training thread at every save.
        if cls is dict and _plain_keys(value):
            return {k: v if (kind := type(v)) in _AS_IS
                    else list(v) if kind is list and _AS_IS.issuperset(map(type, v))
                    else self.encode(v, _join(path, k)) for k, v in value.items()}
        if cls in (dict, collections.OrderedDict):
            items = [[self.encode(k, path), self.encode(v, _join(path, k))] for k, v in value.items()]
            if cls is dict and all(isinstance(k, str) and not k.startswith(TAG) for k in value):
                return {k: v for (k, _), (_, v) in zip(value.items(), items)}
            return {TAG + ("odict" if cls is collections.OrderedDict else "dict"): items}
        if cls is list:
            if _AS_IS.issuperset(map(type, value)):
                return list(value)
            return [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
        if cls is tuple:
            if _AS_IS.issuperset(map(type, value)):  # Python's RNG state: 625 numbers
                return {TAG + "tuple": list(value)}
            return {TAG + "tuple": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}
        allowed = self.classes.get(class_key(cls)) is cls
        if isinstance(value, enum.Enum):
            if allowed:
                return {TAG + "enum": [cls.__module__, cls.__qualname__, self.encode(value.value, path)]}
            return self._refuse(value, path)
        if cls is torch.Size:
            return {TAG + "size": list(value)}
        if allowed and isinstance(value, tuple) and hasattr(cls, "_fields"):
            fields = [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
            return {TAG + "nt": [cls.__module__, cls.__qualname__, fields]}
        if allowed and hasattr(value, "__dict__") and not hasattr(cls, "__slots__"):
            fields = {k: self.encode(v, _join(path, k)) for k, v in vars(value).items()}
            if any(_is_dunder(k) for k in fields):
                return self._refuse(value, path)
            return {TAG + "obj": [cls.__module__, cls.__qualname__, fields]}
        if cls is argparse.Namespace:
            names = vars(value)
            if not any(_is_dunder(k) for k in names):  # plain keys: as a plain dict's (no call per member)
                return {TAG + "ns": self.encode(names, path) if _plain_keys(names)
                        else {k: self.encode(v, _join(path, k)) for k, v in names.items()}}
        if cls in (bytes, bytearray):
            return {TAG + "bytes": _b64(bytes(value))}
        if cls is io.BytesIO:  # Transformer Engine keeps its extra state this way
            return {TAG + "bytesio": _b64(value.getvalue())}
        if cls is torch.dtype:
            name = str(value).removeprefix("torch.")
            if _TORCH_DTYPES.get(name) is value:
                return {TAG + "dtype": name}
        if cls is np.ndarray and value.dtype.kind in _NP_KINDS and _NP_DTYPE.fullmatch(value.dtype.str):
            return {TAG + "nd": [value.dtype.str, list(value.shape), _b64(value.tobytes(order="C"))]}
        if isinstance(value, np.generic) and value.dtype.kind in _NP_KINDS and _NP_DTYPE.fullmatch(value.dtype.str):
            return {TAG + "npscalar": [value.dtype.str, _b64(value.tobytes())]}
        if cls in (set, frozenset):
            tag = "set" if cls is set else "frozenset"
            return {TAG + tag: [self.encode(v, path) for v in sorted(value, key=repr)]}
        if isinstance(value, int):  # int subclasses that are not enums (numpy ints are above): the number
            return int(value)
        if isinstance(value, float):
            return self.encode(float(value), path)
        return self._refuse(value, path)

    def _frozen(self, value: Frozen, path: str) -> Any:
        known = self._memo.get(id(value))
        # The same object (held by the memo, so its id is its own) at the same path: its tensors' names
        # are the same, and none of them is taken yet in this walk.
        if (known is not None and known[0] is value and known[2] == path
                and self._names.isdisjoint(name for name, _ in known[3])):
            self.frozen[id(value)] = known
            self.tensors.extend(known[3])
            self._names.update(name for name, _ in known[3])
            self._nonce = self._nonce or secrets.token_hex(16)
            placeholder = f"{TAG}frozen:{self._nonce}:{len(self._splices)}"
            self._splices[json.dumps(placeholder)] = known[1]
            return placeholder
        first = len(self.tensors)
        skeleton = self.encode(value.value, path)
        self.frozen[id(value)] = (value, json.dumps(skeleton, separators=_COMPACT), path,
                                  tuple(self.tensors[first:]))
        return skeleton

    def dumps(self, skeleton: Any) -> str:
        """``skeleton`` (this walk's result, or a value holding it) as compact JSON, each reused
        ``Frozen`` encoding spliced in where its placeholder stands."""
        text = json.dumps(skeleton, separators=_COMPACT)
        for placeholder, known in self._splices.items():
            text = text.replace(placeholder, known, 1)
        return text

    def _refuse(self, value: Any, path: str) -> Any:
        if self.pickle_fallback:
            return {TAG + "pickle": _b64(pickle.dumps(value, protocol=4))}
        raise EncodeError(
            f"cannot store {class_name(type(value))} at {path or '<root>'!r} safely; convert it to plain Python "
            "types, allow its class (the safe_classes config key, or megatron_ext.engine.add_safe_classes), "
            "or set pickle_fallback=true")

    def _add_tensor(self, path: str, tensor: torch.Tensor) -> str:
        name = path or "tensor"
        if name in self._names or name == "__metadata__":  # that key is reserved by safetensors
            n = 1
            while f"{name}#{n}" in self._names:
                n += 1
            name = f"{name}#{n}"
        self._names.add(name)
        self.tensors.append((name, prepare_tensor(name, tensor) if self.prepare else tensor))
        return name


def prepare_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What a file holds of ``tensor``: it detached (a view, no copy), its lazy conjugate or negative
    bit resolved; ``EncodeError`` unless it is dense."""
    if tensor.layout != torch.strided:
        raise EncodeError(f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors can be "
                          "checkpointed: convert it with .to_dense() first")
    tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():  # lazy conjugate/negative views have no plain bytes
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor


_STR = frozenset((str,))
_COMPACT = (",", ":")
_TAGGED = operator.methodcaller("startswith", TAG)


def _plain_keys(value: dict) -> bool:
    """Every key a str not starting with ``TAG`` (C-level loops: no Python call per key)."""
    return _STR.issuperset(map(type, value)) and not any(map(_TAGGED, value))


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _is_dunder(name: Any) -> bool:
    return isinstance(name, str) and name.startswith("__") and name.endswith("__")


# ------------------------------------------------------------------------------------ decoding
class _Bad(Exception):
    """A malformed value; becomes a CheckpointError with the file and the place."""


class _Placeholder:
    """What ``check`` puts where an object would be built: nothing is looked up or constructed."""


def decode(obj: Any, tensor_for: Callable[[str], torch.Tensor], *, allow_pickle: bool = False,
           classes: Mapping[ClassKey, type] | None = None, where: str = "sidecar") -> Any:
    """Rebuild a state from its skeleton; ``tensor_for(name)`` supplies each referenced tensor.

    ``classes`` adds to the process-wide allow-list. Errors name ``where`` (the file).
    """
    return _Decoder(tensor_for, allow_pickle, allowed_classes(classes), where, build=True).run(obj)


def check(obj: Any, tensor_names: Iterable[str], where: str = "sidecar") -> None:
    """Validate a skeleton's structure without building anything (``verify``): every tag well formed,
    every tensor reference one of ``tensor_names``. Classes are not looked up: which ones may be
    rebuilt is the loader's choice (its allow-list)."""
    names = set(tensor_names)

    def tensor_for(name: str) -> Any:
        if name not in names:
            raise _Bad(f"refers to tensor {name!r}, which the manifest does not list")
        return _Placeholder()

    _Decoder(tensor_for, True, {}, where, build=False).run(obj)


def tensor_refs(obj: Any) -> list[str]:
    """Names of the tensors a skeleton refers to, so a reader can fetch them all in one batch."""
    found: list[str] = []
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if len(node) == 1 and TAG + "t" in node:
                found.append(node[TAG + "t"])
            else:
                stack.extend(node.values())
    return found


class _Decoder:
    def __init__(self, tensor_for: Callable[[str], Any], allow_pickle: bool, classes: Mapping[ClassKey, type],
                 where: str, build: bool):
        self.tensor_for = tensor_for
        self.allow_pickle = allow_pickle
        self.classes = classes
        self.where = where
        self.build = build  # False: check only (no classes looked up, nothing unpickled)

    def run(self, obj: Any) -> Any:
        try:
            return self.value(obj, "")
        except _Bad as exc:
            path, _, message = str(exc).rpartition("\0")
            raise CheckpointError(f"{self.where}: {message}" + (f" (at {path})" if path else "")) from None
        except RecursionError:
            raise CheckpointError(f"{self.where}: the state is nested too deeply to load") from None

    def value(self, obj: Any, path: str) -> Any:
        if type(obj) is list:
            return [self.value(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if type(obj) is not dict:
            if obj is None or type(obj) in (bool, int, float, str):
                return obj
            raise _Bad(f"{path}\0holds a {type(obj).__name__}, which JSON does not produce")
        if len(obj) == 1:
            (key, val), = obj.items()
            if key.startswith(TAG):
                try:
                    return self.tagged(key[1:], val, path)
                except _Bad as exc:
                    raise exc if "\0" in str(exc) else _Bad(f"{path}\0{key}: {exc}") from None
                except (ValueError, TypeError, KeyError, IndexError, OverflowError, binascii.Error) as exc:
                    raise _Bad(f"{path}\0{key}: malformed ({type(exc).__name__}: {exc})") from None
        return {k: self.value(v, f"{path}/{k}") for k, v in obj.items()}

    def tagged(self, tag: str, val: Any, path: str) -> Any:
        rec = lambda v, i="": self.value(v, f"{path}/{i}" if i != "" else path)  # noqa: E731
        if tag == "t":
            if type(val) is not str:
                raise _Bad("a tensor reference must be a name")
            return self.tensor_for(val)
        if tag == "f":
            if val not in ("nan", "inf", "-inf"):
                raise _Bad(f"{val!r} is not nan, inf or -inf")
            return float(val)
        if tag in ("dict", "odict"):
            pairs = []
            for i, pair in enumerate(_list(val)):
                if type(pair) is not list or len(pair) != 2:
                    raise _Bad("entries must be [key, value] pairs")
                pairs.append((self.key(rec(pair[0], i)), rec(pair[1], i)))
            return collections.OrderedDict(pairs) if tag == "odict" else dict(pairs)
        if tag == "tuple":
            return tuple(rec(v, i) for i, v in enumerate(_list(val)))
        if tag in ("set", "frozenset"):
            items = [self.key(rec(v, i)) for i, v in enumerate(_list(val))]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "ns":
            return argparse.Namespace(**self.fields(val, path))
        if tag == "bytes":
            return _unb64(val)
        if tag == "bytesio":
            return io.BytesIO(_unb64(val))
        if tag == "dtype":
            if type(val) is not str or val not in _TORCH_DTYPES:
                raise _Bad(f"unknown torch dtype {val!r}")
            return _TORCH_DTYPES[val]
        if tag == "size":
            return torch.Size(_shape(val, 1))
        if tag == "nd":
            dtype_str, shape, data = _list(val, 3)
            dtype = _np_dtype(dtype_str)
            shape, raw = _shape(shape, dtype.itemsize), _unb64(data)
            if len(raw) != math.prod(shape) * dtype.itemsize:
                raise _Bad(f"{len(raw)} bytes for shape {shape} of {dtype.str}")
            return np.frombuffer(raw, dtype=dtype).reshape(shape).copy() if self.build else _Placeholder()
        if tag == "npscalar":
            dtype_str, data = _list(val, 2)
            dtype, raw = _np_dtype(dtype_str), _unb64(data)
            if len(raw) != dtype.itemsize:
                raise _Bad(f"{len(raw)} bytes for one {dtype.str}")
            return np.frombuffer(raw, dtype=dtype)[0] if self.build else _Placeholder()
        if tag == "enum":
            module, qualname, raw = _list(val, 3)
            raw = rec(raw, 2)
            cls = self.cls(module, qualname, enum.Enum, path)
            return self.member(cls, raw) if cls is not None else _Placeholder()
        if tag == "nt":
            module, qualname, fields = _list(val, 3)
            values = [rec(v, i) for i, v in enumerate(_list(fields))]
            cls = self.cls(module, qualname, tuple, path)
            if cls is None:
                return _Placeholder()
            if not hasattr(cls, "_fields") or len(cls._fields) != len(values):
                raise _Bad(f"{class_name(cls)} takes {len(getattr(cls, '_fields', ()))} fields, not {len(values)}")
            return tuple.__new__(cls, values)
        if tag == "obj":
            module, qualname, fields = _list(val, 3)
            values = self.fields(fields, path)
            cls = self.cls(module, qualname, object, path)
            if cls is None:
                return _Placeholder()
            if issubclass(cls, (enum.Enum, tuple)) or hasattr(cls, "__slots__"):
                raise _Bad(f"{class_name(cls)} objects are not stored field by field")
            instance = cls.__new__(cls)
            vars(instance).update(values)
            return instance
        if tag == "pickle":
            raw = _unb64(val)
            if not self.build:
                return _Placeholder()
            if not self.allow_pickle:
                names = pickle_globals(raw)
                what = f" of class {', '.join(names)}" if names else ""
                raise UnsafeCheckpointError(
                    f"{self.where}: holds a pickled object{what} (at {path or '<root>'}); load it with "
                    "allow_pickle=True only if you trust where it came from",
                    file=self.where, place=path or "<root>", classes=tuple(names), pickled=True)
            return pickle.loads(raw)
        raise _Bad(f"unknown tag {TAG}{tag}")

    def key(self, value: Any) -> Any:
        """A decoded value used as a dict key or set member (JSON lists stand for tuples there)."""
        if isinstance(value, list):
            value = tuple(self.key(v) for v in value)
        try:
            hash(value)
        except TypeError:
            raise _Bad(f"a {type(value).__name__} cannot be a key or set member") from None
        return value

    def fields(self, val: Any, path: str) -> dict[str, Any]:
        if type(val) is not dict:
            raise _Bad("fields must be an object")
        for name in val:
            if _is_dunder(name) or not name:
                raise _Bad(f"field name {name!r} is not allowed")
        return {k: self.value(v, f"{path}/{k}") for k, v in val.items()}

    def cls(self, module: Any, qualname: Any, kind: type, path: str) -> type | None:
        """The allowed class ``module.qualname`` (a plain dictionary lookup), or an error naming it."""
        if type(module) is not str or type(qualname) is not str:
            raise _Bad("a class is named by two strings, module and qualname")
        if not self.build:
            return None
        cls = self.classes.get((module, qualname))
        if cls is None:
            raise UnsafeCheckpointError(
                f"{self.where}: holds an object of class {module}.{qualname}, which this loader does not allow "
                f"(at {path or '<root>'}); if you trust the checkpoint, allow the class (the safe_classes config "
                "key, or megatron_ext.engine.add_safe_classes)",
                file=self.where, place=path or "<root>", classes=(f"{module}.{qualname}",))
        if not issubclass(cls, kind):
            raise _Bad(f"{module}.{qualname} is not a {kind.__name__}")
        return cls

    @staticmethod
    def member(cls: type, raw: Any) -> Any:
        """The member of an allowed enum with value ``raw``, found without calling the class."""
        for member in cls.__members__.values():
            if type(member.value) is type(raw) and member.value == raw:
                return member
        raise _Bad(f"{class_name(cls)} has no member with value {raw!r}")


_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_NO_PUSH_OPS = {"PROTO", "FRAME", "STOP", "MEMOIZE", *_PUT_OPS}


def pickle_globals(raw: bytes, limit: int = 8) -> list[str]:
    """The classes (and functions) a pickle names, read from its opcodes without running it.

    For refusal messages only: the user must see *what* was refused to decide whether to trust it.
    ``GLOBAL``/``INST`` carry the name; ``STACK_GLOBAL`` takes the two strings pushed before it
    (directly or from the memo), which is how ``pickle.dumps`` writes them. An unreadable pickle
    names nothing.
    """
    found: list[str] = []
    pushed: list[Any] = []  # what each pushing opcode left on top (strings only; None otherwise)
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(raw):
            name = op.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.append(f"{module}.{attr}")
            elif name == "STACK_GLOBAL":
                module, attr = (pushed[-2:] if len(pushed) >= 2 else [None, None])
                if isinstance(module, str) and isinstance(attr, str):
                    found.append(f"{module}.{attr}")
                pushed.append(None)
            elif name in _STRING_OPS:
                pushed.append(arg if isinstance(arg, str) else None)
            elif name in _GET_OPS:
                pushed.append(memo.get(arg))
            elif name == "MEMOIZE":
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in _PUT_OPS:
                memo[arg] = pushed[-1] if pushed else None
            elif name not in _NO_PUSH_OPS:
                pushed.append(None)
    except Exception:  # noqa: BLE001 - a malformed pickle: name what was read so far
        pass
    unique = list(dict.fromkeys(found))
    return unique[:limit] + (["..."] if len(unique) > limit else [])


def _list(val: Any, length: int | None = None) -> list:
    if type(val) is not list or (length is not None and len(val) != length):
        raise _Bad(f"expected a list{f' of {length}' if length is not None else ''}, got {type(val).__name__}")
    return val


def _shape(val: Any, itemsize: int) -> list[int]:
    """A shape of whole numbers >= 0 that torch and numpy can index (``layout.shape_elements``)."""
    try:
        shape_elements(val, itemsize)
    except ValueError as exc:
        raise _Bad(f"{str(val)[:80]} is not a shape: {exc}") from None
    return val


def _np_dtype(text: Any) -> np.dtype:
    if type(text) is not str or not _NP_DTYPE.fullmatch(text):
        raise _Bad(f"numpy dtype {text!r} is not allowed (numbers, booleans and strings only)")
    dtype = np.dtype(text)
    if dtype.kind not in _NP_KINDS or dtype.hasobject:
        raise _Bad(f"numpy dtype {text!r} is not allowed")
    return dtype


def _unb64(text: Any) -> bytes:
    if type(text) is not str:
        raise _Bad("binary data must be a base64 string")
    return base64.b64decode(text.encode("ascii"), validate=True)
