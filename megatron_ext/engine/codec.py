"""Safe encoding of the non-tensor part of a state (the sidecar).

Checkpoints may come from elsewhere, so loading must never run code from the file. The nested
state is turned into tagged JSON: containers and plain values map directly, tensors become
references into the safetensors file, and a short list of well-known types (numpy arrays, torch
dtypes, enums of already-imported modules, argparse namespaces) get explicit tags. Anything else
is refused at save time, or, when the user opted into ``pickle_fallback``, stored as a pickle
blob that ``decode`` only unpickles when asked to (``allow_pickle=True``).

Adapters may name module prefixes (``object_modules``, e.g. ``("deepspeed.",)``) whose plain
objects (instances with a ``__dict__``) and named tuples are stored as their fields. Decoding
rebuilds them with ``cls.__new__`` and the stored fields only, for classes of already-imported
modules under the prefixes the loader allows: no import, no ``__setstate__``, no code from the file.
"""

from __future__ import annotations

import argparse
import base64
import collections
import enum
import io
import math
import pickle
import sys
from typing import Any, Callable

import numpy as np
import torch

TAG = "$"  # dicts whose only key starts with TAG are tagged values


class UnsafeCheckpointError(RuntimeError):
    """The checkpoint holds a pickled object and the caller did not allow unpickling."""


class EncodeError(TypeError):
    """A value of the state cannot be stored safely."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


class Encoder:
    """Walks a nested state once: collects tensors (in order) and builds the JSON skeleton."""

    def __init__(self, pickle_fallback: bool = False, object_modules: tuple[str, ...] = ()):
        self.pickle_fallback = pickle_fallback
        self.object_modules = tuple(object_modules)
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._names: set[str] = set()

    def encode(self, value: Any, path: str = "") -> Any:
        if isinstance(value, torch.Tensor):
            return {TAG + "t": self._add_tensor(path, value)}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if isinstance(value, float) and type(value) is float:
            if math.isfinite(value):
                return value
            return {TAG + "f": repr(value)}  # nan, inf, -inf
        if isinstance(value, enum.Enum):
            cls = type(value)
            return {TAG + "enum": [cls.__module__, cls.__qualname__, self.encode(value.value, path)]}
        if isinstance(value, (dict, collections.OrderedDict)) and type(value) in (dict, collections.OrderedDict):
            items = [[self.encode(k, path), self.encode(v, _join(path, k))] for k, v in value.items()]
            if type(value) is dict and all(isinstance(k, str) and not k.startswith(TAG) for k in value):
                return {k: v for (k, _), (_, v) in zip(value.items(), items)}
            tag = "odict" if type(value) is collections.OrderedDict else "dict"
            return {TAG + tag: items}
        if type(value) is list:
            return [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
        if type(value) is tuple:
            return {TAG + "tuple": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}
        cls = type(value)
        if self.object_modules and cls.__module__.startswith(self.object_modules):
            if isinstance(value, tuple) and hasattr(cls, "_fields"):
                fields = [self.encode(v, _join(path, i)) for i, v in enumerate(value)]
                return {TAG + "nt": [cls.__module__, cls.__qualname__, fields]}
            if hasattr(value, "__dict__") and not hasattr(cls, "__slots__"):
                fields = {k: self.encode(v, _join(path, k)) for k, v in vars(value).items()}
                return {TAG + "obj": [cls.__module__, cls.__qualname__, fields]}
        if isinstance(value, argparse.Namespace):
            return {TAG + "ns": {k: self.encode(v, _join(path, k)) for k, v in vars(value).items()}}
        if isinstance(value, (bytes, bytearray)):
            return {TAG + "bytes": _b64(bytes(value))}
        if isinstance(value, io.BytesIO):  # Transformer Engine keeps its extra state this way
            return {TAG + "bytesio": _b64(value.getvalue())}
        if isinstance(value, torch.dtype):
            return {TAG + "dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.Size):
            return {TAG + "size": list(value)}
        if isinstance(value, np.ndarray) and value.dtype != object:
            return {TAG + "nd": [value.dtype.str, list(value.shape), _b64(value.tobytes(order="C"))]}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            return {TAG + "npscalar": [value.dtype.str, _b64(value.tobytes())]}
        if isinstance(value, (set, frozenset)):
            tag = "set" if isinstance(value, set) else "frozenset"
            return {TAG + tag: [self.encode(v, path) for v in sorted(value, key=repr)]}
        if isinstance(value, int):  # int subclasses that are not enums: keep the number
            return int(value)
        if isinstance(value, float):
            return self.encode(float(value), path)
        if self.pickle_fallback:
            return {TAG + "pickle": _b64(pickle.dumps(value, protocol=4))}
        raise EncodeError(
            f"cannot store {type(value).__module__}.{type(value).__qualname__} at {path or '<root>'!r} "
            "safely; convert it to plain Python types or set pickle_fallback=true"
        )

    def _add_tensor(self, path: str, tensor: torch.Tensor) -> str:
        name = path or "tensor"
        if name in self._names or name == "__metadata__":  # that key is reserved by safetensors
            n = 1
            while f"{name}#{n}" in self._names:
                n += 1
            name = f"{name}#{n}"
        self._names.add(name)
        if tensor.layout != torch.strided:
            raise EncodeError(f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors can be "
                              "checkpointed: convert it with .to_dense() first")
        tensor = tensor.detach()
        if tensor.is_conj() or tensor.is_neg():  # lazy conjugate/negative views have no plain bytes
            tensor = tensor.resolve_conj().resolve_neg()
        self.tensors.append((name, tensor))
        return name


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def decode(obj: Any, tensor_for: Callable[[str], torch.Tensor], allow_pickle: bool = False,
           object_modules: tuple[str, ...] = ()) -> Any:
    """Rebuild the state; ``tensor_for(name)`` supplies each referenced tensor."""
    if isinstance(obj, list):
        return [decode(v, tensor_for, allow_pickle, object_modules) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, val), = obj.items()
        if key.startswith(TAG):
            return _decode_tagged(key[1:], val, tensor_for, allow_pickle, tuple(object_modules))
    return {k: decode(v, tensor_for, allow_pickle, object_modules) for k, v in obj.items()}


def tensor_refs(obj: Any) -> list[str]:
    """Names of the tensors a skeleton refers to, so a reader can fetch them all in one batch."""
    found: list[str] = []
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if len(node) == 1 and TAG + "t" in node and isinstance(node[TAG + "t"], str):
                found.append(node[TAG + "t"])
            else:
                stack.extend(node.values())
    return found


def _decode_tagged(tag: str, val: Any, tensor_for, allow_pickle: bool, object_modules: tuple[str, ...]) -> Any:
    rec = lambda v: decode(v, tensor_for, allow_pickle, object_modules)  # noqa: E731
    if tag == "t":
        return tensor_for(val)
    if tag == "f":
        return float(val)
    if tag in ("dict", "odict"):
        pairs = [(_hashable(rec(k)), rec(v)) for k, v in val]
        return collections.OrderedDict(pairs) if tag == "odict" else dict(pairs)
    if tag == "tuple":
        return tuple(rec(v) for v in val)
    if tag == "ns":
        return argparse.Namespace(**{k: rec(v) for k, v in val.items()})
    if tag == "bytes":
        return _unb64(val)
    if tag == "bytesio":
        return io.BytesIO(_unb64(val))
    if tag == "dtype":
        dtype = getattr(torch, val, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {val!r} in checkpoint")
        return dtype
    if tag == "size":
        return torch.Size(val)
    if tag == "nd":
        dtype, shape, data = val
        return np.frombuffer(_unb64(data), dtype=np.dtype(dtype)).reshape(shape).copy()
    if tag == "npscalar":
        dtype, data = val
        return np.frombuffer(_unb64(data), dtype=np.dtype(dtype))[0]
    if tag in ("set", "frozenset"):
        items = (_hashable(rec(v)) for v in val)
        return set(items) if tag == "set" else frozenset(items)
    if tag == "enum":
        module, qualname, raw = val
        return _resolve_enum(module, qualname, rec(raw))
    if tag in ("obj", "nt"):
        module, qualname, fields = val
        cls = _resolve_class(module, qualname) if module.startswith(object_modules or ("\0",)) else None
        if cls is None:
            raise UnsafeCheckpointError(
                f"checkpoint holds a {module}.{qualname} object; it loads only when that module is "
                "imported and the loader allows its package (object_modules)")
        if tag == "nt":
            return cls(*[rec(v) for v in fields])
        instance = cls.__new__(cls)
        instance.__dict__.update({k: rec(v) for k, v in fields.items()})
        return instance
    if tag == "pickle":
        if not allow_pickle:
            raise UnsafeCheckpointError(
                "checkpoint contains a pickled object; load it with allow_pickle=True only if you "
                "trust where it came from"
            )
        return pickle.loads(_unb64(val))
    raise ValueError(f"unknown tag {TAG}{tag} in checkpoint sidecar")


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _resolve_class(module: str, qualname: str) -> type | None:
    """A class from an already-imported module, or None: decoding never imports anything."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj if isinstance(obj, type) else None


def _resolve_enum(module: str, qualname: str, raw: Any) -> Any:
    """Enums come back as members only if their module is already imported, else as raw values."""
    cls = _resolve_class(module, qualname)
    if cls is not None and issubclass(cls, enum.Enum):
        return cls(raw)
    return raw


