"""States to save and the exact comparison of what comes back: the engine settings that make
small states exercise chunking (``TINY``) and fail fast (``FAST``), deterministic state builders
(the same arguments give the same bytes, in this process or a worker), bit-exact comparison."""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: Tiny host cache (~105 KB) and the smallest chunk (4 KiB): chunk boundaries fall inside tensors.
TINY = {"host_cache_size": 0.0001, "chunk_size_mb": 0.004}
#: Short bounds so a broken engine fails a test instead of hanging it.
FAST = {"snapshot_timeout_s": 30.0, "persist_timeout_s": 30.0}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor's row-major image (bit-exact comparison, NaN-safe)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_tensor_exact(got: Any, want: torch.Tensor, what: str = "tensor") -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: bytes differ"
    if not (want.is_floating_point() and torch.isnan(want).any()):
        assert torch.equal(got, want), f"{what}: values differ"


def assert_same(got: Any, want: Any, path: str = "<root>") -> None:
    """Deep, type-strict, bit-exact comparison of nested states."""
    if isinstance(want, torch.Tensor):
        assert_tensor_exact(got, want, path)
        return
    assert type(got) is type(want), f"{path}: type {type(got)} != {type(want)}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), f"{path}: array bytes differ"
    elif isinstance(want, (dict, collections.OrderedDict)):
        assert list(got.keys()) == list(want.keys()), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k!r}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, argparse.Namespace):
        assert_same(vars(got), vars(want), f"{path}.ns")
    elif isinstance(want, float) and want != want:
        assert got != got, f"{path}: expected nan"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def clone_state(value: Any) -> Any:
    """A deep copy with every tensor cloned (the reference to compare a loaded state with)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, collections.OrderedDict):
        return collections.OrderedDict((k, clone_state(v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if type(value) is list:
        return [clone_state(v) for v in value]
    if type(value) is tuple:
        return tuple(clone_state(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, argparse.Namespace):
        return argparse.Namespace(**{k: clone_state(v) for k, v in vars(value).items()})
    return value


def committed_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists()) if root.exists() else []


def seeded_state(i: int, n: int = 20_000, matrix: tuple[int, int] | None = None, /, seed: int | None = None,
                 **extra: Any) -> dict:
    """``{"w": n normal floats, "t": a transposed (non-contiguous) rows x cols matrix when ``matrix``
    is given, **extra, "step": i}`` drawn from a generator seeded with ``seed`` (default ``i``).

    An ``extra`` value that is callable is called with the generator (random extras); ``i``, ``n``
    and ``matrix`` are positional, so an extra may be called ``i``."""
    g = torch.Generator().manual_seed(i if seed is None else seed)
    state: dict[str, Any] = {"w": torch.randn(n, generator=g)}
    if matrix is not None:
        state["t"] = torch.randn(*matrix, generator=g).t()
    for key, value in extra.items():
        state[key] = value(g) if callable(value) else value
    state["step"] = i
    return state


def step_state(rank: int, i: int) -> dict:
    """One rank's state at iteration ``i`` in the overload tests (a different stream per rank)."""
    return seeded_state(i, 6000, (20, 30), seed=7919 * rank + i)


def rank_state(rank: int, part: str) -> dict:
    """One rank's ``part`` ("model" or "optim") in the distributed tests: every rank's differs."""
    g = torch.Generator().manual_seed(1000 * rank + (1 if part == "model" else 2))
    return {
        "w": torch.randn(3000 + rank, generator=g),
        "t": torch.randn(40, 30, generator=g).t(),
        "ids": torch.arange(rank, rank + 17),
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "rank": rank, "part": part,
    }


def through_a_checkpoint(directory: Path, state: Any) -> Any:
    """``state`` saved, committed and loaded back by a fresh engine writing under ``directory``."""
    from megatron_ext.engine import CheckpointEngine

    engine = CheckpointEngine({"save_dir": str(directory), "host_cache_size": 0.01})
    try:
        engine.save(state, "ckpt", version=1)
        engine.commit("ckpt")
        engine.wait_persisted()
        return engine.load("ckpt")
    finally:
        engine.shutdown()
