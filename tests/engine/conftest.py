"""Shared helpers for the checkpoint engine tests: engines that always shut down, exact comparisons,
fault hooks that are always disarmed, and child processes with bounded run times."""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_ext.engine import CheckpointEngine, faults

# Test modules import these helpers as ``engine_testlib``: the name ``conftest`` is ambiguous
# (tests/conftest.py and other directories' conftests share it).
sys.modules.setdefault("engine_testlib", sys.modules[__name__])

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

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


@pytest.fixture
def make_engine(tmp_path):
    """``make_engine(**config)``: an engine on ``tmp_path/ckpt`` (rank 0 of 1), shut down at teardown.

    A second writing engine on the same directory is refused (the directory lock); loaders that
    run beside a writer pass ``read_only=True``.
    """
    engines: list[CheckpointEngine] = []

    def factory(rank: int = 0, world_size: int = 1, run_id: str | None = None, read_only: bool = False,
                **config: Any) -> CheckpointEngine:
        cfg = dict(FAST)
        cfg.setdefault("save_dir", str(tmp_path / "ckpt"))
        cfg.update(config)
        engine = CheckpointEngine(cfg, rank=rank, world_size=world_size, run_id=run_id, read_only=read_only)
        engines.append(engine)
        return engine

    yield factory
    faults.disarm_all()
    for engine in engines:
        try:
            engine.shutdown(timeout=10)
        except Exception:
            pass


@pytest.fixture
def fault():
    """``fault(hook)`` arms a write hook; every hook is disarmed at teardown."""
    yield faults.arm
    faults.disarm_all()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_python(code: str, *args: str, timeout: float = 90, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (the engine's own process), bounded by ``timeout``."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=child_env(), cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)
    if check_rc is not None:
        assert proc.returncode == check_rc, (
            f"child exited {proc.returncode}, expected {check_rc}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def committed_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").exists()) if root.exists() else []
