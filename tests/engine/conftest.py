"""Fixtures of the checkpoint engine tests: engines that always shut down and fault hooks that are
always disarmed. Shared helpers are in ``tests/helpers`` (``helpers.states``, ``helpers.procs``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from megatron_ext.engine import CheckpointEngine, faults

from helpers.states import FAST


@pytest.fixture
def make_engine(tmp_path):
    """``make_engine(**config)``: an engine on ``tmp_path/ckpt`` (rank 0 of 1), shut down at teardown.

    A second writing engine on the same directory is refused (the directory lock); loaders that
    run beside a writer pass ``read_only=True``.
    """
    engines: list[CheckpointEngine] = []
    store = dist.HashStore()  # in-process ranks of one test agree on commits through it

    def factory(rank: int = 0, world_size: int = 1, run_id: str | None = None, read_only: bool = False,
                **config: Any) -> CheckpointEngine:
        cfg = dict(FAST)
        cfg.setdefault("save_dir", str(tmp_path / "ckpt"))
        cfg.update(config)
        engine = CheckpointEngine(cfg, rank=rank, world_size=world_size, run_id=run_id, read_only=read_only,
                                  commit_store=store)
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
