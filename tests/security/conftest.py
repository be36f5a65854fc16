"""Fixtures of the hostile-checkpoint suite; its library is ``helpers.hostile``. The audit hook is
installed once per process, here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.hostile import Audit, copy_checkpoint, save_genuine

_AUDIT = Audit()
sys.addaudithook(_AUDIT)


@pytest.fixture
def audit() -> Audit:
    return _AUDIT


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A path that a successful attack would create (``touch``) or delete; it starts existing."""
    path = tmp_path / "canary"
    path.write_text("alive")
    return path


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """One genuine save directory (``C1``, ``C2``), written once; tests tamper with copies."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    save_genuine(root, [1, 2])
    return root


@pytest.fixture
def genuine(tmp_path: Path, pristine: Path) -> Path:
    """``tmp_path/ckpt``: a fresh copy of the genuine save directory with committed ``C1`` and ``C2``."""
    root = tmp_path / "ckpt"
    copy_checkpoint(pristine, root)
    return root


